"""Greedy output equals transformers' generate token for token, batched, in every mode."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from tests.support.tiny_models import VOCAB, hf_greedy

MAX_NEW = 12


def _prompts(n=9, seed=1):
    rng = random.Random(seed)
    lengths = [1, 3, 7, 16, 17, 30, 45, 64, 5][:n]
    return [[rng.randrange(3, VOCAB) for _ in range(k)] for k in lengths]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_ref(request):
    folder = request.getfixturevalue(f"tiny_{request.param}")
    prompts = _prompts()
    return folder, prompts, hf_greedy(folder, prompts, MAX_NEW)


MODES = {
    "page16": dict(page_size=16),
    "page1": dict(page_size=1),
    "chunked_prefill": dict(page_size=4, max_num_batched_tokens=7),
    # 48 usable tokens for 9 requests of up to 76 tokens: forces preemption and recompute.
    "preemption": dict(page_size=4, num_kv_pages=20),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(family_ref, mode):
    folder, prompts, expected = family_ref
    llm = LLM(str(folder), **MODES[mode])
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.engine.kv.allocator.num_used == 0
    if mode == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


def _generate_sharded(runs: list[tuple[str, str]], tp: int) -> list[list[list[int]]]:
    """Each (model folder, mode) under `tp` ranks (rank 0 here, the others spawned)."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = []
    for folder, mode in runs:
        with LLM(folder, tensor_parallel_size=tp, debug_tp_check=True, **MODES[mode]) as llm:
            outs.append([o.token_ids for o in llm.generate(_prompts(), params)])
            assert llm.engine.kv.allocator.num_used == 0
    return outs


@pytest.mark.parametrize(
    "tp, runs",
    [
        (2, [("llama", "preemption"), ("qwen2", "chunked_prefill")]),
        # fewer KV heads (2) than ranks: replicated, with preemption's recompute (each
        # family's logits at every size: tests/model/test_tensor_parallel.py)
        (4, [("qwen3", "preemption")]),
    ],
)
def test_greedy_matches_transformers_under_tensor_parallelism(request, tp, runs):
    from tests.support.spawned import run_spawned

    folders = {name: request.getfixturevalue(f"tiny_{name}") for name, _ in runs}
    status, outs = run_spawned(
        _generate_sharded, [(str(folders[name]), mode) for name, mode in runs], tp
    )
    assert status == "ok", outs
    for (name, _), got in zip(runs, outs):
        assert got == hf_greedy(folders[name], _prompts(), MAX_NEW), name
