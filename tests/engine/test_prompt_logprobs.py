"""prompt_logprobs: every prompt token after the first rated by transformers' own forward
(log-softmax of its logits at the position before), whatever the chunking, preemption,
prefix cache (bypassed: cached tokens have no logits), speculation and loop."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from tests.support.overlap_cases import make_models, prompts_for, spec_kwargs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


@pytest.fixture(scope="module")
def expected(models):
    """Per prompt: transformers' log-softmax rows at positions 0..n-2."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32)
    out = []
    for prompt in _prompts():
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].float()
        out.append(logits.log_softmax(-1)[:-1])
    return out


def _prompts():
    prompts = [p for p in prompts_for(seed=4, lengths=(21, 9, 37, 2, 30, 1, 3, 5)) if len(p) > 1]
    return prompts + [prompts[0]]  # (the repeat would find the first's pages cached)


CASES = {
    "whole": {},
    "chunked, preempted, overlapped, EAGLE-3": dict(
        max_num_batched_tokens=16,
        page_size=4,
        num_kv_pages=14,
        overlap_schedule="on",
        drafter="eagle3",
    ),
    "draft model, page size 1": dict(page_size=1, drafter="copy"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logprobs_equal_transformers(models, expected, case):
    kw = dict(CASES[case])
    llm = LLM(models["target"], **spec_kwargs(models, kw.pop("drafter", None)), **kw)
    params = SamplingParams(max_tokens=6, prompt_logprobs=3, ignore_eos=True)
    outs = llm.generate(_prompts(), params)
    for out, ref in zip(outs, expected):
        ids = out.prompt_token_ids
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        for p, lp in enumerate(out.prompt_logprobs[1:]):
            row = ref[p]
            assert lp.logprob == pytest.approx(row[ids[p + 1]].item(), abs=1e-4)
            top_lp, top_ids = row.topk(3)
            assert [t for t, _ in lp.top] == top_ids.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top_lp.tolist(), abs=1e-4)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hit_tokens"] == 0  # the repeat was computed whole
    if "preempted" in case:
        assert stats["preemptions"] > 0
    plain = llm.generate(_prompts(), SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in plain] == [o.token_ids for o in outs]
    assert all(o.prompt_logprobs is None for o in plain)
