"""The GPU engine benchmark's own arithmetic, run on the CPU at a tiny shape (`--tiny`): the
rows it reports and the markdown tables the committed results come from; the tensor-parallel
benchmark's dry run on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.interpreter_run import child_timeout

REPO = Path(__file__).resolve().parents[2]


def test_gpu_engine_bench_reports_whole_run_and_full_batch_rates(tmp_path):
    out = tmp_path / "bench"
    env = dict(
        os.environ, PYTHONPATH=str(REPO / "src"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"
    )  # (one intra-op thread, as below)
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "gpu_engine.py"),
        "--tiny",
        "--batches",
        "1",
        "3",
        "--prompt-len",
        "16",
        "--new-tokens",
        "12",
        "--repeats",
        "2",
        "--only",
        "plain",
        "K=3 fixed",
        "--again",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=child_timeout(300))
    results = json.loads(out.with_suffix(".json").read_text())
    again = results.pop("plain (again, last)")
    assert list(results) == ["plain", "eagle3 K=3 fixed (sim. accept len 3.0)"]
    # the same engine built again computes the same tokens: the same digests, repeat by
    # repeat (and the repeats' prompts differ, so theirs differ)
    digests = [r["tokens_sha256"] for r in results["plain"]["rows"]]
    assert digests == [r["tokens_sha256"] for r in again["rows"]]
    assert all(len(set(d)) == 2 for d in digests)
    for name, res in results.items():
        assert [r["batch"] for r in res["rows"]] == [1, 3]
        for row in res["rows"]:
            assert len(row["repeats"]) == 2
            # every request produced its tokens; the first of each came with the prefill
            assert row["decode_tokens"] == 2 * row["batch"] * 11
            seconds, tokens = row["full_batch"]
            assert 0 < tokens <= row["decode_tokens"] and 0 < seconds <= row["seconds"]
            assert row["full_batch_tok_s"] == round(tokens / seconds, 1)
            if name == "plain" or row["batch"] == 1:  # all start and end together
                assert tokens == row["decode_tokens"]
    md = out.with_suffix(".md").read_text()
    assert md.count("| plain | ") == 2 and "While every request decodes" in md
    speculative = [line for line in md.splitlines() if line.startswith("| eagle3")]
    assert len(speculative) == 2 and all("x)" in line for line in speculative)


def test_paired_ratio_pairs_each_repeat_with_plains_run_of_that_repeat():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from gpu_default_model import paired_ratio
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    def row(*runs):  # (start second, tok/s) of each run, out of run order
        return {"runs_started_s_tok_s": sorted(runs, key=lambda run: run[1])}

    plain = row((0.0, 100.0), (10.0, 50.0), (20.0, 100.0), (30.0, 100.0))  # a slow stretch
    spec = row((1.0, 150.0), (11.0, 60.0), (21.0, 140.0), (31.0, 130.0))  # at 10 s
    # per repeat 1.5, 1.2, 1.4, 1.3: their median 1.35 (the reported median runs, the
    # third of four by rate, give 140 against 100: 1.40)
    assert paired_ratio(spec, plain) == 1.35
    spec = row((1.0, 150.0), (11.0, 60.0), (21.0, 140.0))
    plain = row((0.0, 100.0), (10.0, 50.0), (20.0, 100.0))
    assert paired_ratio(spec, plain) == 1.4  # odd count: the middle ratio (1.2, 1.4, 1.5)
    assert paired_ratio(row((1.0, 150.0)), row((0.0, 100.0))) is None  # one run
    assert paired_ratio(spec, row((0.0, 100.0), (10.0, 50.0))) is None  # unpaired


def test_gpu_default_bench_interleaves_engines_and_speculation_equals_own_plain(tmp_path):
    # the default model (embedded GGUF) and its shipped head on the CPU (`--smoke`: batches
    # 1 and 2, a few tokens, two runs at batch 2; plain, fixed K=3 and goodput); every
    # engine alive, runs interleaved
    out = tmp_path / "default"
    # one intra-op thread: the interpreter runs share the machine
    # (tests/support/interpreter_run.py), and spinning threads on a busy 2-core machine slow
    # every op down many times
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "gpu_default_model.py"),
        "--smoke",
        "--only",
        "fixed",
        "goodput",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=child_timeout(900))
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    names = ["plain", "eagle3 K=3 fixed", "eagle3 goodput (default)"]
    assert list(results) == names
    starts = []  # batch 2's runs: (start, config), every configuration's first run first
    for name in names:
        one, two = results[name]["rows"]
        assert (one["batch"], two["batch"]) == (1, 2)
        runs = two["runs_started_s_tok_s"]
        assert len(runs) == 2 and sorted(r for _, r in runs) == two["tok_s_of_runs"]
        starts += [(s, name) for s, _ in runs]
        if name != "plain":  # greedy speculation reproduces the engine's own K=0 tokens
            assert one["identical_to_own_k0"] == one["requests"] == 1
            assert two["identical_to_own_k0"] == two["requests"] == 2
        # the median of each repeat's rate over plain's run of the same repeat
        base = [t for _, t in sorted(results["plain"]["rows"][1]["runs_started_s_tok_s"])]
        mine = [t for _, t in sorted(runs)]
        expected = sorted(a / b for a, b in zip(mine, base))
        assert two["x_plain_paired"] == round((expected[0] + expected[1]) / 2, 3)
        assert "x_plain_paired" not in one  # one run at batch 1: nothing to pair
    assert [name for _, name in sorted(starts)] == names * 2
    md = out.with_suffix(".md").read_text()
    assert "| plain | " in md and md.count("paired") == 3  # batch 2 of each configuration


def test_the_tensor_parallel_benchmark_dry_run(tmp_path, monkeypatch):
    """benchmarks/tp_engine.py on gloo at a tiny shape (its dry run): every tensor-parallel
    size, configuration and head design runs, outputs are the same at every size and for
    both head designs, and the collective share is measured where there are collectives."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    sys.modules.pop("tp_engine", None)
    import tp_engine

    for name, value in tp_engine.NO_MULTICAST.items():  # (restored after the test)
        monkeypatch.setenv(name, value)

    out = tmp_path / "tp"
    argv = ["--cpu", "--model", "tiny", "--tp", "1", "2", "--batches", "2", "--prompt-len", "8"]
    argv += ["--new-tokens", "6", "--profile-steps", "2", "--heads", "replicated", "sharded"]
    results = tp_engine.main([*argv, "--out", str(out)])
    rows = {(r["tp"], r["config"]): r for r in results["rows"]}
    configs = ("plain", "k3, head replicated", "k3, head sharded")
    assert set(rows) == {(tp, c) for tp in (1, 2) for c in configs}
    # the same tokens whatever the number of ranks, and (acceptance simulated: the drafts
    # are the output) the same drafts from the head whole or sharded
    assert len({rows[(tp, c)]["tokens_sha256"][0] for tp in (1, 2) for c in configs[1:]}) == 1
    for config in configs:
        assert rows[(1, config)]["tokens_sha256"] == rows[(2, config)]["tokens_sha256"]
        assert rows[(1, config)]["collective_share"] is None  # one rank: no collective
        assert 0 < rows[(2, config)]["collective_share"] < 1
        assert rows[(2, config)]["output_tok_s"] > 0
    assert rows[(1, configs[1])]["tokens_per_request_step"] > 1  # K=3 drafts (simulated 3.0)
    assert results["env"]["NCCL_NVLS_ENABLE"] == "0"  # NVLink multicast off, for the ranks too
    table = out.with_suffix(".md").read_text()
    assert "| k3, head sharded | 2 |" in table and "TP=2 tok/s" in table
