"""`specserve bench serve` and `bench sweep` against a live specserve with a tiny model: the
report's request and token counts equal what the server's own /metrics counted."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from specserve.bench.server_process import ServerProcess
from specserve.cli import main


def server_counts(url: str) -> dict[str, float]:
    """Completion requests answered 200, prompt and generated tokens, straight from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text

    def total(pattern: str) -> float:
        return sum(float(m.group(1)) for m in re.finditer(pattern + r" ([-0-9.e+]+)$", text, re.M))

    return {
        "ok": total(
            r'specserve_requests_total\{endpoint="/v1/(?:chat/)?completions",'
            r'status="200"\}'
        ),
        "prompt_tokens": total(r"specserve_prompt_tokens_total"),
        "generation_tokens": total(r"specserve_generation_tokens_total"),
        "draft_tokens": total(r"specserve_spec_draft_tokens_total"),
        "accepted_tokens": total(r"specserve_spec_accepted_tokens_total"),
    }


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    # n-gram speculation on, so the report's speculation section is exercised too.
    args = [
        "--model",
        str(tiny_llama),
        "--speculative-algorithm",
        "ngram",
        "--speculative-policy",
        "fixed",
        "--speculative-num-steps",
        "2",
    ]
    log = tmp_path_factory.mktemp("bench-server") / "server.log"
    with ServerProcess(args, log, env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


def run_bench(capsys, *args: str) -> tuple[int, str]:
    rc = main(["bench", "serve", "--no-progress", *args])
    out = capsys.readouterr().out
    return rc, out


def test_counts_equal_server_metrics(server, tiny_llama, tmp_path, capsys):
    before = server_counts(server.url)
    result = tmp_path / "run.json"
    rc, out = run_bench(
        capsys,
        "--base-url",
        server.url + "/v1",
        "--dataset",
        "random",
        "--tokenizer",
        str(tiny_llama),
        "--num-prompts",
        "6",
        "--max-concurrency",
        "3",
        "--input-len",
        "24",
        "--output-len",
        "8",
        "--range-ratio",
        "0.5",
        "--ignore-eos",
        "--save-result",
        str(result),
    )
    assert rc == 0
    after = server_counts(server.url)
    report = json.loads(result.read_text())
    assert report["completed"] == 6 and report["failed"] == 0 and report["errors"] == {}
    assert report["completed"] == after["ok"] - before["ok"]
    assert report["total_output_tokens"] == after["generation_tokens"] - before["generation_tokens"]
    assert report["total_input_tokens"] == after["prompt_tokens"] - before["prompt_tokens"]
    assert report["token_counts_from_usage"]
    assert report["server"]["requests_by_status"] == {"200": 6}
    assert report["server"]["generation_tokens"] == report["total_output_tokens"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        assert report[key]["p50"] is not None and report[key]["p50"] >= 0
    # the server's time to first token, in parts stamped on one clock that add up to it
    parts = report["server"]["ttft_parts_ms_mean"]
    assert set(parts) == {"to_engine", "in_engine", "back"} and min(parts.values()) >= 0
    assert sum(parts.values()) == pytest.approx(report["server"]["ttft_ms_mean"], rel=1e-6)
    # and the server's time before submission and after its first tokens (streamed requests)
    outside = report["server"]["ttft_outside_ms_mean"]
    assert set(outside) == {"intake", "first_chunk"} and min(outside.values()) > 0
    assert sum(outside.values()) < report["ttft_ms"]["mean"] - report["server"]["ttft_ms_mean"]
    assert report["output_throughput"] > 0
    assert "tokenizer of" in report["dataset"]["notes"][0]
    if "specserve_spec_draft_tokens_total" in httpx.get(server.url + "/metrics").text:
        spec = report["server"]["speculation"]
        assert spec["draft_tokens"] == after["draft_tokens"] - before["draft_tokens"]
        assert spec["accepted_tokens"] == after["accepted_tokens"] - before["accepted_tokens"]
    assert "output throughput" in out and "requests completed" in out


def test_ignore_eos_gives_max_tokens(server, tmp_path, capsys):
    result = tmp_path / "run.json"
    rc, _ = run_bench(
        capsys,
        "--base-url",
        server.url,
        "--dataset",
        "stdlib",
        "--num-prompts",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "5",
        "--ignore-eos",
        "--save-result",
        str(result),
    )
    report = json.loads(result.read_text())
    assert rc == 0 and report["total_output_tokens"] == 4 * 5
    assert any("no local tokenizer" in n for n in report["dataset"]["notes"])


def test_chat_conversations_with_poisson_arrivals(server, tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    lines = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "The quick brown fox"},
            ],
            "max_tokens": 4,
        },
        {
            "conversations": [
                {"from": "human", "value": "Paged attention stores"},
                {"from": "gpt", "value": "keys and values"},
            ]
        },
        {"prompt": "Speculative decoding drafts tokens"},
    ]
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    before = server_counts(server.url)
    result = tmp_path / "chat.json"
    rc, _ = run_bench(
        capsys,
        "--base-url",
        server.url,
        "--endpoint",
        "chat",
        "--dataset",
        "jsonl",
        "--dataset-path",
        str(data),
        "--num-prompts",
        "5",
        "--request-rate",
        "40",
        "--output-len",
        "6",
        "--save-result",
        str(result),
    )
    after = server_counts(server.url)
    report = json.loads(result.read_text())
    assert rc == 0 and report["completed"] == 5
    assert report["completed"] == after["ok"] - before["ok"]
    assert report["total_output_tokens"] == after["generation_tokens"] - before["generation_tokens"]
    assert report["total_input_tokens"] == after["prompt_tokens"] - before["prompt_tokens"]
    assert report["config"]["request_rate"] == 40


def test_multi_turn_conversations_grow_turn_by_turn(server, tiny_llama, tmp_path, capsys):
    """Multi-turn chats with a shared system prefix: every turn answered (the server takes
    the assistant messages of the history), the counts equal /metrics, each turn's prompt
    is longer than the last by at least its new 8-token question, and the server's prefix
    cache serves most of the later turns' prompts."""
    before = server_counts(server.url)
    result = tmp_path / "turns.json"
    rc, out = run_bench(
        capsys,
        "--base-url",
        server.url,
        "--endpoint",
        "chat",
        "--dataset",
        "multi-turn",
        "--turns",
        "3",
        "--num-prompts",
        "2",
        "--max-concurrency",
        "2",
        "--shared-prefix-len",
        "16",
        "--tokenizer",
        str(tiny_llama),
        "--input-len",
        "8",
        "--output-len",
        "5",
        "--ignore-eos",
        "--save-result",
        str(result),
    )
    after = server_counts(server.url)
    report = json.loads(result.read_text())
    assert rc == 0 and report["completed"] == 6 == after["ok"] - before["ok"]
    assert report["total_input_tokens"] == after["prompt_tokens"] - before["prompt_tokens"]
    assert [t["completed"] for t in report["by_turn"]] == [2, 2, 2]
    means = [t["prompt_tokens_mean"] for t in report["by_turn"]]
    assert means[1] - means[0] >= 8 and means[2] - means[1] >= 8
    # later turns find the earlier turns' pages in the server's prefix cache (whole pages)
    assert 0 < report["prefix_cache_hit_share"] < 1 and report["cached_tokens_reported"] == 6
    assert report["total_cached_prompt_tokens"] % 16 == 0
    assert all(t["prefix_cache_hit_share"] > 0.3 for t in report["by_turn"][1:])
    assert "turn 3: TTFT mean (ms)" in out


def test_sweep_writes_json_table_and_plot(tiny_llama, tmp_path, capsys):
    out_dir = tmp_path / "sweep"
    rc = main(
        [
            "bench",
            "sweep",
            "--model",
            str(tiny_llama),
            "--config",
            "off=",
            "--concurrency",
            "1,2",
            "--num-prompts",
            "2",
            "--dataset",
            "random",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--ignore-eos",
            "--warmup",
            "1",
            "--omp-threads",
            "1",
            "--output-dir",
            str(out_dir),
            "--name",
            "tiny",
            "--no-progress",
            "--requests-per-concurrency",
            "2",
        ]
    )
    assert rc == 0
    sweep = json.loads((out_dir / "tiny.json").read_text())
    assert [(r["label"], r["config"]["max_concurrency"]) for r in sweep["results"]] == [
        ("off", 1),
        ("off", 2),
    ]
    # max(--num-prompts, 2 x concurrency) requests a level
    assert [r["num_requests"] for r in sweep["results"]] == [2, 4]
    for r in sweep["results"]:
        assert r["completed"] == r["num_requests"]
        assert r["total_output_tokens"] == 4 * r["num_requests"] == r["server"]["generation_tokens"]
        assert r["server"]["step_ms_mean"] > 0 and r["server"]["loop_waits"] >= 0
    assert sweep["machine"]["cpu_count"] >= 1 and sweep["partial"] is False
    page = (out_dir / "tiny.md").read_text()
    assert page.count("\n| off |") == 2 and "specserve bench sweep" in page
    assert "![" in page and "tiny.png" in page
    assert (out_dir / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_side_by_side_rounds_take_turns(tiny_llama, tmp_path, capsys):
    """--rounds 2: both servers up at once, each level measured once a round by each
    configuration in turn, the order rotated; medians with paired ratios to the first
    configuration in the JSON and on the page, the plot from the median rounds."""
    out_dir = tmp_path / "rounds"
    rc = main(
        [
            "bench",
            "sweep",
            "--model",
            str(tiny_llama),
            "--server-args=--num-kv-pages 64",
            "--config",
            "off=",
            "--config",
            "ngram=--speculative-algorithm ngram --speculative-policy fixed",
            "--concurrency",
            "1,2",
            "--rounds",
            "2",
            "--num-prompts",
            "2",
            "--dataset",
            "random",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--ignore-eos",
            "--warmup",
            "1",
            "--omp-threads",
            "1",
            "--output-dir",
            str(out_dir),
            "--name",
            "turns",
            "--no-progress",
        ]
    )
    assert rc == 0
    sweep = json.loads((out_dir / "turns.json").read_text())
    order = [(r["round"], r["config"]["max_concurrency"], r["label"]) for r in sweep["results"]]
    assert order == [
        (0, 1, "off"),
        (0, 1, "ngram"),
        (0, 2, "off"),
        (0, 2, "ngram"),
        (1, 1, "ngram"),
        (1, 1, "off"),
        (1, 2, "ngram"),
        (1, 2, "off"),
    ]
    assert all(r["completed"] == r["num_requests"] for r in sweep["results"])
    assert sweep["rounds"] == 2 and sweep["partial"] is False
    summary = {(e["config"], e["concurrency"]): e for e in sweep["summary"]}
    assert set(summary) == {(n, c) for n in ("off", "ngram") for c in (1, 2)}
    for (name, c), e in summary.items():
        runs = [
            r["output_throughput"]
            for r in sweep["results"]
            if r["label"] == name and r["config"]["max_concurrency"] == c
        ]
        assert e["rounds"] == 2 and e["output_throughput_median"] == pytest.approx(sum(runs) / 2)
        assert e["reference"] == "off" and e["ratio_to"] > 0
    assert summary[("off", 1)]["ratio_to"] == 1.0
    page = (out_dir / "turns.md").read_text()
    assert "side by side, 2 rounds" in page and "÷ off (median of rounds)" in page
    assert "| ngram (round 2) | 1 |" in page
    assert (out_dir / "turns.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_matrix_mode_runs_each_server_at_every_point(tiny_llama, tmp_path):
    """Two servers (off, goodput at one simulated acceptance), two closed-loop levels and one
    Poisson rate: rows, server /metrics figures, ratios, page and plot."""
    out_dir = tmp_path / "matrix"
    rc = main(
        [
            "bench",
            "sweep",
            "--matrix",
            "adaptive",
            "--model",
            str(tiny_llama),
            "--server-args",
            "--speculative-algorithm ngram",
            "--policies",
            "off,goodput",
            "--acceptance",
            "1.5",
            "--concurrency",
            "1,2",
            "--request-rates",
            "20",
            "--poisson-seconds",
            "0.2",
            "--num-prompts",
            "2",
            "--dataset",
            "random",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--ignore-eos",
            "--warmup",
            "1",
            "--omp-threads",
            "1",
            "--output-dir",
            str(out_dir),
            "--name",
            "mx",
            "--no-progress",
        ]
    )
    assert rc == 0
    matrix = json.loads((out_dir / "mx.json").read_text())
    assert matrix["kind"] == "specserve-bench-matrix" and matrix["skipped"] == []
    assert [s["name"] for s in matrix["servers"]] == ["off", "goodput@L1.5"]
    points = [("closed", 1), ("closed", 2), ("poisson", 20.0)]
    assert [
        (r["matrix"]["config"], r["matrix"]["arrival"], r["matrix"]["level"])
        for r in matrix["results"]
    ] == [("off", *p) for p in points] + [("goodput", *p) for p in points]
    for r in matrix["results"]:
        assert r["completed"] == r["num_requests"] == 8  # MIN_REQUESTS: the floor per point
        assert r["total_output_tokens"] == 8 * 4 == r["server"]["generation_tokens"]
        goodput = r["matrix"]["policy"] == "goodput"
        assert ("--speculative-simulate-acceptance" in r["server_flags"]) == goodput
    assert matrix["results"][-1]["server"]["speculation"]["simulated_acceptance"]
    ratios = matrix["ratios"]
    assert [(r["arrival"], r["level"]) for r in ratios] == points
    for r in ratios:
        assert r["best_baseline"] == "off" and r["all_requests_ok"]
        if r["arrival"] == "closed":  # (by throughput; Poisson points by mean e2e latency)
            tput = r["output_throughput"]
            assert r["goodput_over_off"] == r["goodput_over_best"] == tput["goodput"] / tput["off"]
        else:
            e2e = r["e2e_latency_ms_mean"]
            assert r["goodput_over_off"] == r["goodput_over_best"] == e2e["off"] / e2e["goodput"]
    page = (out_dir / "mx.md").read_text()
    assert "## Acceptance 1.5" in page and "| closed | c=2 |" in page and "mx.png" in page
    assert (out_dir / "mx.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
