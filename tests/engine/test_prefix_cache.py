"""Prefix caching through the engine: output identical with caching on and off for every
proposer, policy and loop (shared system prompts, multi-turn histories, repeats, forced
preemption), cache hits that really happen, drafter state reused only where valid, and page
counts exact at the end. With caching off every configuration's greedy output is plain
decoding's, so most tests compare with one plain run (`plain`) instead of a run of their
own configuration with caching off."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from specserve.speculative.policy_base import PerRequestPolicy
from tests.support.overlap_cases import (
    StepDraftLens,
    make_models,
    random_draft_lens,
    record_drafts,
    spec_kwargs,
)
from tests.support.tiny_models import VOCAB

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


def _conversations(seed=5, n=4, system_len=37):
    """First turns: one system prompt, then each request's own question."""
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(system_len)]
    return [
        system + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 20))] for _ in range(n)
    ]


def _run(models, drafter, caching: bool, k_mode="fixed", system_len=37, **kw):
    """Two rounds: first turns; then each second turn (first turn + its answer + a new
    question) with one first turn repeated. Returns (outputs, per-request accepted drafts,
    engine stats)."""
    spec = spec_kwargs(models, drafter)
    if k_mode == "goodput":
        spec["speculative_policy"] = "goodput"
    llm = LLM(models["target"], disable_prefix_caching=not caching, **spec, **kw)
    if k_mode == "random":
        random_draft_lens(llm)
    elif k_mode == "step":
        llm.engine.spec.policy = StepDraftLens(llm.engine.spec.k_max, seed=4)
    elif k_mode == "dormant_first":  # the first turns' drafter is left behind
        policy = llm.engine.spec.policy
        llm.engine.spec.policy = PerRequestPolicy(policy.k_max, lambda req: 0)
        llm.engine.spec.policy.dormant = True
    drafts = record_drafts(llm) if drafter else {}
    rng = random.Random(9)
    first = _conversations(system_len=system_len)
    outs = llm.generate(first, GREEDY)
    if k_mode == "dormant_first":
        llm.engine.spec.policy = policy
    second = [
        p + o.token_ids + [rng.randrange(3, VOCAB) for _ in range(5)] for p, o in zip(first, outs)
    ]
    outs2 = llm.generate(second + [first[2]], GREEDY)
    engine = llm.engine
    assert engine.kv.allocator.num_used == 0 and not engine.requests  # nothing held
    results = [o.token_ids for o in outs + outs2]
    return results, {**engine.stats(), "drafts": drafts}


@pytest.fixture(scope="module")
def plain(models):
    """Both rounds' outputs of plain decoding, caching off (the synchronous loop)."""
    return _run(models, None, False)[0]


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("drafter", [None, "ngram", "copy", "eagle3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_identical_with_caching(models, plain, drafter, page_size, overlap):
    on, stats = _run(models, drafter, True, page_size=page_size, overlap_schedule=overlap)
    assert on == plain
    # second turns find their first turn (prompt and answer), the repeat its whole prompt
    assert stats["prefix_cache_hit_tokens"] > 4 * 40


@pytest.mark.parametrize("k_mode", ["fixed", "dormant_first"])
@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("drafter", ["copy", "eagle3"])
def test_drafter_state_reused_where_valid(models, drafter, overlap, k_mode):
    """With a fixed K the drafter drafts the same tokens from cached pages as from
    recomputed ones, at every step of every request, and takes fewer tokens to catch up:
    its entries on cached pages were reused, and only where they were valid (stale entries,
    e.g. a page's last one made for another successor token, change the drafts).
    `dormant_first`: the first turns never update the drafter, so their pages carry no
    drafter entries and the second turns' drafters catch up over the cached pages."""
    # The system prompt fills 9 pages: its last page's successor is each request's own.
    kw = dict(page_size=4, overlap_schedule=overlap, system_len=36)
    off, off_stats = _run(models, drafter, False, k_mode, **kw)
    on, stats = _run(models, drafter, True, k_mode, **kw)
    assert on == off
    assert len(stats["drafts"]) > 10 and stats["drafts"] == off_stats["drafts"]
    if k_mode == "fixed":
        assert stats["spec_drafter_eager_tokens"] < off_stats["spec_drafter_eager_tokens"]


@pytest.mark.parametrize("drafter", ["copy", "eagle3"])
@pytest.mark.parametrize("k_mode", ["random", "step", "goodput"])
def test_draft_length_policies_identical(models, plain, drafter, k_mode):
    """Random K per request, one random K per step, and the goodput policy."""
    kw = dict(page_size=4, overlap_schedule="off" if k_mode == "random" else "on")
    assert _run(models, drafter, True, k_mode, **kw)[0] == plain


@pytest.mark.parametrize("drafter", [None, "eagle3", "copy"])
def test_preemption_identical(models, plain, drafter, monkeypatch):
    """A cache too small for the batch: requests are preempted, their pages go back to the
    cache and they find them again (re-admitted, a preempted request starts from cached
    pages past its prompt: its output's, published when it was preempted)."""
    from specserve.core.prefix_cache import PrefixCache

    readmitted = []  # cached tokens past its prompt a preempted request found again
    attach = PrefixCache.attach

    def spy(self, req):
        attach(self, req)
        if req.num_preemptions:
            readmitted.append(req.cached_len - len(req.prompt_token_ids))

    monkeypatch.setattr(PrefixCache, "attach", spy)
    kw = dict(page_size=4, num_kv_pages=40, max_num_batched_tokens=24, overlap_schedule="on")
    on, stats = _run(models, drafter, True, **kw)
    assert on == plain
    assert stats["preemptions"] > 0 and stats["prefix_cache_evictions"] > 0
    assert readmitted and max(readmitted) > 0
    # each request's prompt counts once in the hit rate, however often it was admitted
    roomy = _run(models, drafter, True, page_size=4, overlap_schedule="on")[1]
    assert roomy["preemptions"] == 0
    assert stats["prefix_cache_queried_tokens"] == roomy["prefix_cache_queried_tokens"]


def test_a_running_requests_prompt_is_found_by_the_next(models):
    """A prompt's pages are published once computed, while its request still runs: a
    request arriving then with the same system prompt starts from them."""
    llm = LLM(models["target"], page_size=4)
    engine = llm.engine
    system = _conversations(n=1, system_len=33)[0][:33]
    engine.add_request(system + [7, 8, 9], SamplingParams(max_tokens=30, ignore_eos=True), "a")
    for _ in range(3):
        engine.step()
    engine.add_request(system + [10, 11], SamplingParams(max_tokens=2, ignore_eos=True), "b")
    engine.step()
    (first,) = [r for r in engine.scheduler.running if r.request_id == "a"]
    (second,) = [r for r in engine.scheduler.running if r.request_id == "b"]
    assert second.num_cached_prompt_tokens == 32  # (the system prompt's whole pages)
    assert first.num_left > 0  # (still running)
