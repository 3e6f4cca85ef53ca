"""`specserve bench throughput` on the CPU with a tiny checkpoint: every request makes its
output_len tokens (EOS ignored), the counts and the engine's counters add up, and the random
prompts are seeded token ids inside the vocabulary."""

from __future__ import annotations

import json
import math
import time

import pytest

from specserve.bench.throughput import (
    arrival_times,
    engine_counts,
    prompt_token_ids,
    random_prompts,
    run_arrivals,
)
from specserve.cli import main
from specserve.model.loader import load_tokenizer, resolve_model


def test_prompts_are_seeded_ids_of_the_vocabulary(tiny_llama):
    tok = load_tokenizer(resolve_model(str(tiny_llama)))
    vocab = prompt_token_ids(tok, vocab_size=300)  # a model vocabulary smaller than the tokenizer's
    assert max(vocab) < 300 and not set(vocab) & set(tok.all_special_ids)
    prompts = random_prompts(3, 7, vocab, seed=5)
    assert [len(p) for p in prompts] == [7, 7, 7] and prompts == random_prompts(3, 7, vocab, 5)
    assert prompts != random_prompts(3, 7, vocab, 6)
    assert prompt_token_ids(None, 10) == list(range(10))


def test_engine_counts_are_the_timed_runs():
    before = {
        "steps": 4,
        "preemptions": 1,
        "spec_steps_by_draft_len": [3, 1],
        "loop_wait_reasons": {"sampled": 2},
        "kv_pages_total": 100,
    }
    after = {
        "steps": 10,
        "preemptions": 1,
        "spec_steps_by_draft_len": [5, 1, 7],
        "loop_wait_reasons": {"sampled": 3, "host_drafts": 4},
        "kv_pages_total": 100,
    }
    assert engine_counts(before, after) == {
        "steps": 6,
        "preemptions": 0,
        "spec_steps_by_draft_len": [2, 0, 7],
        "loop_wait_reasons": {"sampled": 1, "host_drafts": 4},
    }
    # steps by kind: the run's, each kind's mean time, kinds without a step in it left out
    before["steps_by_kind"] = {"decode K=0": 3, "prefill K=0": 1}
    before["step_ms_by_kind"] = {"decode K=0": 3.0, "prefill K=0": 2.0}
    after["steps_by_kind"] = {"decode K=0": 7, "prefill K=0": 1, "prefill K=2": 2}
    after["step_ms_by_kind"] = {"decode K=0": 11.0, "prefill K=0": 2.0, "prefill K=2": 9.0}
    counts = engine_counts(before, after)
    assert counts["steps_by_kind"] == {"decode K=0": 4, "prefill K=2": 2}
    assert counts["step_ms_by_kind_mean"] == {"decode K=0": 2.0, "prefill K=2": 4.5}


def test_arrival_times_are_a_seeded_poisson_process():
    times = arrival_times(4000, rate=50.0, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and min(gaps) >= 0 and times == arrival_times(4000, 50.0, 3)
    assert times != arrival_times(4000, 50.0, 4)
    mean = sum(gaps) / len(gaps)  # exponential gaps: mean 1/rate, standard deviation 1/rate
    assert abs(mean - 0.02) < 0.02 * 4 / len(gaps) ** 0.5  # within four standard errors
    assert sum(g > 0.02 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.03)
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]


def test_arrivals_reach_the_engine_by_the_clock(tiny_llama):
    """A request is handed over only once it has arrived, and its latencies count from its
    arrival, not from the start of the run."""
    from specserve import LLM, SamplingParams

    llm = LLM(str(tiny_llama), progress=False)
    engine, added = llm.engine, []
    add = engine.add_request

    def timed_add(*args, **kw):
        added.append(time.perf_counter())
        return add(*args, **kw)

    engine.add_request = timed_add
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    run = run_arrivals(engine, [[5, 6, 7], [8, 9, 10]], params, [0.0, 0.3])
    assert added[0] - start < 0.1 and added[1] - start >= 0.3
    assert run["handed_s"][1] >= 0.3 and len(run["handed_s"]) == 2
    assert [len(o.token_ids) for o in run["outputs"]] == [4, 4]
    first_done = run["e2e_s"][0]  # the first ran alone, then the engine idled until 0.3 s
    assert first_done < 0.3 and run["elapsed_s"] >= 0.3
    assert 0 < run["ttft_s"][1] <= run["e2e_s"][1] <= run["elapsed_s"] - 0.3 + 1e-6
    assert engine.stats()["running"] == 0 and engine.kv.allocator.num_used == 0


def test_throughput_counts_every_token(tiny_llama, tmp_path, capsys):
    out = tmp_path / "tp.json"
    rc = main(
        [
            "bench",
            "throughput",
            "--model",
            str(tiny_llama),
            "--num-prompts",
            "5",
            "--input-len",
            "12",
            "--output-len",
            "6",
            "--num-warmup",
            "2",
            "--speculative-algorithm",
            "ngram",
            "--speculative-policy",
            "fixed",
            "--speculative-num-steps",
            "2",
            "--no-progress",
            "--save-result",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["kind"] == "specserve-bench-throughput" and report["model"] == tiny_llama.name
    assert report["num_requests"] == 5 and report["finish_reasons"] == {"length": 5}
    assert report["total_output_tokens"] == 5 * 6 and report["total_prompt_tokens"] == 5 * 12
    elapsed = report["elapsed_s"]
    assert abs(report["requests_per_s"] * elapsed - 5) < 1e-9
    assert abs(report["total_tokens_per_s"] * elapsed - 90) < 1e-6
    assert abs(report["output_tokens_per_s"] * elapsed - 30) < 1e-6
    counts = report["engine_counts"]
    # 6 tokens each, the first from the prefill: at least 6 steps, at most one per token
    assert 6 <= counts["steps"] <= 30 and counts["preemptions"] == 0
    assert report["engine_config"]["speculative_num_steps"] == 2
    spec = report["speculation"]
    assert spec is not None and spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["draft_tokens"] <= 2 * spec["verify_steps"]  # K=2: two drafts at most a step
    assert "output tokens/s" in capsys.readouterr().out


def test_throughput_under_poisson_arrivals(tiny_llama, tmp_path, capsys):
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", str(tiny_llama), "--num-prompts", "6"]
    argv += ["--input-len", "12", "--output-len", "5", "--request-rate", "40", "--seed", "2"]
    assert main(argv + ["--no-progress", "--save-result", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["workload"]["request_rate"] == 40
    assert report["finish_reasons"] == {"length": 6} and report["total_output_tokens"] == 30
    arrivals = arrival_times(6, 40.0, 2)
    lat = report["latency"]
    # the rate achieved (handed over at step boundaries: a little late, never early)
    assert 0 < lat["arrival_rate"] <= 5 / (arrivals[-1] - 0.05)
    assert report["elapsed_s"] >= arrivals[-1]
    e2e, ttft, tpot = lat["e2e_latency_ms"], lat["ttft_ms"], lat["tpot_ms"]
    assert 0 < ttft["mean"] <= e2e["mean"] <= report["elapsed_s"] * 1e3
    assert ttft["p50"] <= ttft["p99"] and 0 < tpot["mean"] < e2e["mean"]
    kinds = report["engine_counts"]["steps_by_kind"]
    assert sum(kinds.values()) == report["engine_counts"]["steps"]
    assert set(report["engine_counts"]["step_ms_by_kind_mean"]) == set(kinds)
    printed = capsys.readouterr().out
    assert "E2E mean / p50 / p90 / p99 (ms)" in printed and "step kind" in printed


def test_bad_workload_exits_2(tiny_llama, capsys):
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--input-len", "0"]) == 2
    assert "--input-len" in capsys.readouterr().err
    argv = ["bench", "throughput", "--model", str(tiny_llama), "--request-rate", "0"]
    assert main(argv) == 2
    assert "--request-rate must be > 0; got 0.0" in capsys.readouterr().err
    # past the context, requests would end early and the figures mean less: refused
    argv = ["bench", "throughput", "--model", str(tiny_llama), "--max-model-len", "300"]
    assert main(argv + ["--input-len", "200", "--output-len", "101", "--no-progress"]) == 2
    assert (
        "--input-len 200 + --output-len 101 exceeds the model's context of 300 tokens"
        in capsys.readouterr().err
    )
