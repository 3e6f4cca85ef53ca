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
