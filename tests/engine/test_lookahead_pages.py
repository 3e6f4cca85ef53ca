"""Speculation under KV pressure. Its lookahead pages give way: requests that fit the KV cache
together are never preempted because another request holds pages for drafts it will not run
(a step's draft length cut to what every request's pages allow) or for drafts past its
max_tokens, and a waiting request gets pages before any lookahead. A request preempted while
its drafts are in flight (overlap) resumes exactly. Output stays plain decoding's."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from specserve.speculative.policy_base import PerRequestPolicy
from tests.support.overlap_cases import make_models, spec_kwargs
from tests.support.tiny_models import VOCAB


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


def _prompts(lengths: list[int], seed: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


# (drafter, page size, usable pages, prompt lengths, max_tokens): the requests' final lengths
# fill the cache exactly (5 + 6 pages of 4; 10 + 6 pages of 1)
CASES = [
    ("ngram", 4, 11, [17, 19], [3, 5]),
    ("eagle3", 1, 16, [6, 2], [4, 4]),
]


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize(("drafter", "page_size", "pages", "lengths", "max_tokens"), CASES)
def test_requests_that_fit_are_not_preempted_for_lookahead(
    models, overlap, drafter, page_size, pages, lengths, max_tokens
):
    prompts = _prompts(lengths)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    kw = dict(page_size=page_size, num_kv_pages=pages + 1, overlap_schedule=overlap)
    plain = LLM(models["target"], **kw).generate(prompts, params)
    llm = LLM(models["target"], speculative_num_steps=4, **kw, **spec_kwargs(models, drafter))
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    engine = llm.engine
    assert engine.scheduler.num_preemptions == 0  # (before: 1, in each loop)
    assert engine.kv.allocator.num_used == 0


def test_a_waiting_request_gets_pages_before_lookahead(models):
    """Two requests drafting 4 ahead have taken the free pages when a third arrives whose
    prompt fits only with those pages back: it is admitted at the next step, not left
    waiting until a running request ends."""
    llm = LLM(
        models["target"],
        page_size=1,
        num_kv_pages=41,
        speculative_num_steps=4,
        max_num_seqs=3,
        **spec_kwargs(models, "ngram"),
    )
    engine = llm.engine
    first = _prompts([8, 8])
    for i, p in enumerate(first):
        engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True), f"r{i}")
    for _ in range(3):
        engine.step()
    held = sum(len(r.page_table) for r in engine.scheduler.running)
    lookahead = held - sum(r.cached_len for r in engine.scheduler.running)
    assert lookahead >= 6  # (drafts' pages beyond the committed tokens)
    late = _prompts([40 - held + 4], seed=7)[0]  # fits only with lookahead given back
    engine.add_request(late, SamplingParams(max_tokens=4, ignore_eos=True), "late")
    engine.step()
    assert "late" in [r.request_id for r in engine.scheduler.running]
    assert engine.scheduler.num_preemptions == 0


def test_a_request_preempted_with_drafts_in_flight_resumes_as_plain_decoding(models):
    """Overlap, 16 pages of 4 for six requests, drafts (a copy of the target: accepted) for
    every other request: one is preempted while its drafts are in flight, and the accepted
    ones that step brings must not count as its computed KV (its pages are gone)."""
    rng, prompts, params = random.Random(1), [], []
    for _ in range(6):
        prompts.append([rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 20))])
        params.append(SamplingParams(max_tokens=rng.randrange(5, 30), ignore_eos=True))
    plain = LLM(models["target"], disable_prefix_caching=True).generate(prompts, params)
    llm = LLM(
        models["target"],
        page_size=4,
        num_kv_pages=16,
        overlap_schedule="on",
        **spec_kwargs(models, "copy"),
    )
    engine = llm.engine
    k = engine.spec.k_max
    engine.spec.policy = PerRequestPolicy(k, lambda req: k * (int(req.request_id[-1]) % 2))
    scheduler, in_flight = engine.scheduler, []
    preempt = scheduler._preempt

    def spy(req):
        in_flight.append(req.num_inflight_drafts)
        preempt(req)

    scheduler._preempt = spy
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert any(in_flight)  # (what the test is for)
