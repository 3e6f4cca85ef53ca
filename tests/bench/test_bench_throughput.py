"""`specserve bench throughput` on the CPU with a tiny checkpoint: every request makes its
output_len tokens (EOS ignored), the counts and the engine's counters add up, and the random
prompts are seeded token ids inside the vocabulary."""

from __future__ import annotations

import json

from specserve.bench.throughput import engine_counts, prompt_token_ids, random_prompts
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


def test_bad_workload_exits_2(tiny_llama, capsys):
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--input-len", "0"]) == 2
    assert "--input-len" in capsys.readouterr().err
    # past the context, requests would end early and the figures mean less: refused
    argv = ["bench", "throughput", "--model", str(tiny_llama), "--max-model-len", "300"]
    assert main(argv + ["--input-len", "200", "--output-len", "101", "--no-progress"]) == 2
    assert (
        "--input-len 200 + --output-len 101 exceeds the model's context of 300 tokens"
        in capsys.readouterr().err
    )
