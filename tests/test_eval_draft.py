"""`specserve eval-draft` measures acceptance by real speculative decoding."""

from __future__ import annotations

import json

from specserve.cli import main


def test_eval_draft_copy_drafter_accepts_everything(tiny_llama, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "\n".join(json.dumps({"prompt": f"The quick brown fox number {i}"}) for i in range(12))
    )
    out = tmp_path / "eval.json"
    rc = main([
        "eval-draft", "--target", str(tiny_llama), "--algorithm", "draft",
        "--draft", str(tiny_llama), "--data", str(data), "--num-prompts", "4",
        "--max-tokens", "12", "--k", "1", "3", "--out", str(out),
    ])
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    assert [r["k"] for r in results] == [1, 3]
    for r in results:
        assert r["drafted"] > 0 and r["accepted"] == r["drafted"]
        assert r["position_rates"] == [1.0] * r["k"]
        assert 1.0 < r["mean_accept_len"] <= r["k"] + 1
    assert "mean accept len" in capsys.readouterr().out
    # K in the order given; --append keeps the earlier results.
    rc = main([
        "eval-draft", "--target", str(tiny_llama), "--algorithm", "draft",
        "--draft", str(tiny_llama), "--data", str(data), "--num-prompts", "2",
        "--max-tokens", "6", "--k", "2", "1", "2", "--out", str(out), "--append",
    ])
    assert rc == 0
    assert [r["k"] for r in json.loads(out.read_text())["results"]] == [1, 3, 2, 1]


def test_table_without_rich(monkeypatch, capsys):
    """GPU machines may lack rich: the results print as plain lines."""
    import sys

    from specserve.spec.eval_draft import DraftEval, _print_table

    monkeypatch.setitem(sys.modules, "rich.console", None)  # import fails
    _print_table("t", [DraftEval(k=2, verify_steps=4, drafted=8, accepted=6,
                                 position_rates=[0.9, 0.6])])
    out = capsys.readouterr().out
    assert "2 | 2.500 | 6/8 | 0.90 0.60" in out
