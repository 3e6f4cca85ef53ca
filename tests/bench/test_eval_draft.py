"""`specserve eval-draft` measures acceptance by real speculative decoding."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest
import torch

from specserve import ConfigError
from specserve.bench.eval_draft import draft_path
from specserve.cli import main
from specserve.core.config import shipped_head_path


def write_prompts(path, count: int):
    path.write_text(
        "\n".join(json.dumps({"prompt": f"The quick brown fox number {i}"}) for i in range(count))
    )
    return path


@pytest.fixture
def no_loading(monkeypatch):
    import specserve.llm as llm

    def loading(*args, **kwargs):
        raise AssertionError("the model loader was reached")

    monkeypatch.setattr(llm.LLM, "__init__", loading)


def test_eval_draft_copy_drafter_accepts_everything(tiny_llama, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "\n".join(json.dumps({"prompt": f"The quick brown fox number {i}"}) for i in range(12))
    )
    out = tmp_path / "eval.json"
    rc = main(
        [
            "eval-draft",
            "--target",
            str(tiny_llama),
            "--algorithm",
            "draft",
            "--draft",
            str(tiny_llama),
            "--data",
            str(data),
            "--split",
            "all",
            "--num-prompts",
            "4",
            "--max-tokens",
            "12",
            "--k",
            "1",
            "3",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    assert [r["k"] for r in results] == [1, 3]
    for r in results:
        assert r["drafted"] > 0 and r["accepted"] == r["drafted"]
        assert r["position_rates"] == [1.0] * r["k"]
        assert 1.0 < r["mean_accept_len"] <= r["k"] + 1
    assert "mean accept len" in capsys.readouterr().out
    # K in the order given; --append keeps the earlier results.
    rc = main(
        [
            "eval-draft",
            "--target",
            str(tiny_llama),
            "--algorithm",
            "draft",
            "--draft",
            str(tiny_llama),
            "--data",
            str(data),
            "--split",
            "all",
            "--num-prompts",
            "2",
            "--max-tokens",
            "6",
            "--k",
            "2",
            "1",
            "2",
            "--out",
            str(out),
            "--append",
        ]
    )
    assert rc == 0
    assert [r["k"] for r in json.loads(out.read_text())["results"]] == [1, 3, 2, 1]


def test_several_sources_are_reported_side_by_side(tiny_llama, tmp_path, capsys):
    """--data with two files: the run's totals and each file's own figures from the same
    run (a copy drafter accepts everything in both), printed side by side."""
    a = write_prompts(tmp_path / "a.jsonl", 8)
    b = tmp_path / "b.jsonl"
    b.write_text("\n".join(json.dumps({"prompt": f"Paged attention {i} stores"}) for i in range(8)))
    out = tmp_path / "eval.json"
    argv = ["eval-draft", "--target", str(tiny_llama), "--algorithm", "draft"]
    argv += ["--draft", str(tiny_llama), "--data", str(a), str(b), "--split", "all"]
    argv += ["--num-prompts", "4"]
    assert main([*argv, "--max-tokens", "8", "--k", "2", "--out", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert set(result["by_source"]) == {"a.jsonl", "b.jsonl"}
    mine = result["by_source"].values()
    assert sum(f["num_prompts"] for f in mine) == 4
    assert sum(f["verify_steps"] for f in mine) == result["verify_steps"]
    assert sum(f["accepted"] for f in mine) == result["accepted"]
    for f in mine:
        assert f["num_prompts"] > 0 and f["accepted"] == f["drafted"] > 0
        assert f["position_rates"] == [1.0, 1.0]
    printed = capsys.readouterr().out
    assert "mean accept len by source: K | a.jsonl | b.jsonl | all" in printed


def test_a_sources_position_rates_come_from_its_histogram():
    from specserve.bench.eval_draft import _source_figures
    from specserve.core.request import SpecStats

    one, two = SpecStats(), SpecStats()
    for accepted in (0, 1, 2, 2):
        one.record(2, accepted)
    two.record(2, 1)
    figures = _source_figures(2, [one, two])
    # steps accepting 0/1/2: 1/2/2; position 0: 4 of 5 went on; position 1: 2 of 4
    assert figures["position_rates"] == [0.8, 0.5]
    assert figures["verify_steps"] == 5 and figures["accepted"] == 6
    assert figures["mean_accept_len"] == pytest.approx(11 / 5)


def test_a_source_counts_only_the_positions_a_step_drafted():
    """A step that drafted fewer than K (a request's last tokens) and accepted them all
    judged no later position: a source's per-position acceptance counts as the engine-wide
    figure does (AcceptanceModel), not as a rejection at the next position."""
    from specserve.bench.eval_draft import _source_figures
    from specserve.core.request import SpecStats
    from specserve.speculative.acceptance import AcceptanceModel

    steps = [(3, 3), (3, 3), (1, 1), (2, 2), (3, 1), (2, 0), (3, 2)]  # (drafted, accepted)
    stats, engine_wide = SpecStats(), AcceptanceModel(3)
    for drafted, accepted in steps:
        stats.record(drafted, accepted)
        engine_wide.update("r", drafted, accepted)
    assert stats.position_verified == [7, 5, 3] and stats.position_accepted == [6, 4, 2]
    rates = _source_figures(3, [stats])["position_rates"]
    assert rates == [round(r, 4) for r in engine_wide.position_rates()]
    assert rates == [round(6 / 7, 4), 0.8, round(2 / 3, 4)]


def test_table_without_rich(monkeypatch, capsys):
    """GPU machines may lack rich: the results print as plain lines."""
    import sys

    from specserve.bench.eval_draft import DraftEval, _print_table

    monkeypatch.setitem(sys.modules, "rich.console", None)  # import fails
    _print_table(
        "t", [DraftEval(k=2, verify_steps=4, drafted=8, accepted=6, position_rates=[0.9, 0.6])]
    )
    out = capsys.readouterr().out
    assert "2 | 2.500 | 6/8 | 1.000 | 0.90 0.60" in out


def test_the_embedded_model_is_evaluated_with_its_shipped_head():
    assert draft_path(Namespace(draft=None, algorithm="eagle3", target=None)) == str(
        shipped_head_path()
    )
    assert draft_path(Namespace(draft="h", algorithm="eagle3", target=None)) == "h"
    assert draft_path(Namespace(draft=None, algorithm="ngram", target="m")) is None
    with pytest.raises(ConfigError, match="--algorithm eagle3 needs --draft .*no --target"):
        draft_path(Namespace(draft=None, algorithm="eagle3", target="some/model"))
    with pytest.raises(ConfigError, match="--algorithm draft needs --draft"):
        draft_path(Namespace(draft=None, algorithm="draft", target=None))


def test_a_split_that_selects_no_prompts_is_an_error(tmp_path, capsys, no_loading):
    empty = str(write_prompts(tmp_path / "none.jsonl", 0))
    for split, message in (
        ("heldout", "--split heldout: --data holds 0 prompts that no train-eagle3 run"),
        ("train", "--split train selects no prompts: --data has 0 prompts"),
        ("all", "--split all selects no prompts: --data has 0 prompts"),
    ):
        assert main(["eval-draft", "--data", empty, "--split", split]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err


def test_the_heldout_split_holds_no_prompt_a_training_run_trains_on(tmp_path, capsys, no_loading):
    """Held out are only the prompts every training run of the seed keeps out, whatever
    its --heldout-prompts (a run reserves the --heldout-prompts lowest-hashed texts when
    that is more than 2%: eval-draft's own --num-prompts once stood for that count, so
    asking for more prompts than a run reserved took prompts it trained on). Asking for
    more than there are is refused; --split all takes a file's prompts as they are."""
    from specserve.bench.eval_draft import select_prompts
    from specserve.train.prompts import always_held_out, jsonl_prompts, load_prompts

    data = write_prompts(tmp_path / "prompts.jsonl", 600)
    fixed = {p.key for p in jsonl_prompts(data) if always_held_out(0, p)}
    assert 0 < len(fixed) < 32
    args = Namespace(data=[str(data)], seed=0, split="heldout", num_prompts=len(fixed))
    items, _ = select_prompts(args)
    assert {p.key for p in items} == fixed
    for num_heldout in (0, 4, 64):  # what training runs of this seed train on
        trained, held = load_prompts([str(data)], 0, None, num_heldout)
        assert not {p.key for p in trained} & fixed
    assert {p.key for p in held} > fixed  # (64 held out: the 64 lowest-hashed)
    rc = main(["eval-draft", "--data", str(data), "--split", "heldout"])  # 32 asked for
    err = capsys.readouterr().err
    assert rc == 2 and f"--data holds {len(fixed)} prompts that no train-eagle3 run" in err
    assert f"lower --num-prompts to {len(fixed)}" in err and "--split all" in err
    args.split, args.num_prompts = "all", 1000
    items, _ = select_prompts(args)
    assert [p.key for p in items] == [f"prompts.jsonl:{i}" for i in range(1, 601)]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--k", "0"], "--k must be at least 1"),
        (["--num-prompts", "0"], "--num-prompts must be at least 1"),
        (["--algorithm", "draft"], "--algorithm draft needs --draft"),
        pytest.param(
            ["--device", "cuda"],
            "--device cuda needs a CUDA GPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA"),
        ),
    ],
)
def test_bad_arguments_are_refused_before_loading(tmp_path, capsys, no_loading, argv, message):
    data = write_prompts(tmp_path / "prompts.jsonl", 12)
    assert main(["eval-draft", "--data", str(data), "--num-prompts", "2", *argv]) == 2
    assert message in capsys.readouterr().err


def _randomized_copy(folder, dest):
    """The head at `folder` with every weight redrawn at random (its vocabulary maps kept)."""
    from safetensors.torch import load_file, save_file

    dest.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (dest / f.name).write_bytes(f.read_bytes())
    gen = torch.Generator().manual_seed(0)
    tensors = {
        name: (torch.randn(w.shape, generator=gen) * 0.02).to(w.dtype)
        if w.is_floating_point()
        else w
        for name, w in load_file(folder / "model.safetensors").items()
    }
    save_file(tensors, dest / "model.safetensors")
    return dest


@pytest.mark.slow
def test_the_shipped_head_runs_by_default_and_beats_a_random_head(tmp_path):
    """The embedded model's head, evaluated by default, drafts everyday questions (never
    trained on) far better than the same head with random weights."""
    questions = shipped_head_path().parent / "everyday_questions.jsonl"

    def mean_accept_len(*draft: str) -> float:
        out = tmp_path / f"eval{len(draft)}.json"
        argv = ["eval-draft", *draft, "--data", str(questions), "--split", "all"]
        argv += ["--num-prompts", "3", "--max-tokens", "32", "--k", "3", "--out", str(out)]
        assert main(argv) == 0
        saved = json.loads(out.read_text())
        assert saved["num_prompts"] == 3 and saved["results"][0]["drafted"] > 0
        assert saved["draft"] == (draft[1] if draft else str(shipped_head_path()))
        return saved["results"][0]["mean_accept_len"]

    shipped = mean_accept_len()
    random = mean_accept_len("--draft", str(_randomized_copy(shipped_head_path(), tmp_path / "r")))
    assert shipped >= 1.5 and random <= 1.1, (shipped, random)


def _eval_draft_main(argv: list[str]) -> int:
    from specserve.cli import main as cli_main

    return cli_main(argv)


def test_eval_draft_under_tensor_parallelism(tiny_llama, tmp_path):
    """--tp 2 (CPU, gloo): rank 0's fixed policy sets each K for both ranks; the copy
    drafter (whole on each rank) drafts what the sharded target, equal up to rounding,
    mostly takes."""
    from tests.support.spawned import run_spawned

    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Count to {i}"}) for i in range(8)))
    out = tmp_path / "eval.json"
    argv = ["eval-draft", "--target", str(tiny_llama), "--algorithm", "draft"]
    argv += ["--draft", str(tiny_llama), "--data", str(data), "--split", "all"]
    argv += ["--num-prompts", "2"]
    argv += ["--max-tokens", "8", "--k", "2", "--tp", "2", "--out", str(out)]
    assert run_spawned(_eval_draft_main, argv) == ("ok", 0)
    (result,) = json.loads(out.read_text())["results"]
    assert result["k"] == 2 and result["drafted"] > 0
    assert result["accepted"] >= 0.9 * result["drafted"]
