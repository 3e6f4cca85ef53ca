"""Scheduler invariants through the real engine on a tiny model: preemption mid-decode keeps
greedy output, a request larger than the cache is refused, no page leaks after an abort or a
finish (test_scheduler.py: the same invariants on a simulated engine)."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, RequestTooLargeError, SamplingParams
from specserve.core.request import RequestStatus
from tests.support.spies import spy_on
from tests.support.tiny_models import VOCAB

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _prompts(n, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 14))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    prompts = _prompts(5)
    outs = LLM(str(tiny_llama)).generate(prompts, GREEDY)
    return prompts, [o.token_ids for o in outs]


def test_engine_preemption_mid_decode_keeps_greedy_output(tiny_llama, reference):
    prompts, expected = reference
    # 6 usable pages of 4 tokens; every request needs up to 6 pages of its own.
    llm = LLM(str(tiny_llama), page_size=4, num_kv_pages=7)
    engine = llm.engine
    events = []
    original = engine.scheduler._preempt

    def spy(req):
        running = [r.request_id for r in engine.scheduler.running]
        mid_decode = len(req.output_token_ids) > 0
        original(req)
        events.append(
            (
                req.request_id,
                running,
                mid_decode,
                list(req.page_table),
                req.cached_len,
                [r.request_id for r in engine.scheduler.waiting],
            )
        )

    spy_on(engine.scheduler, "_preempt", spy)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    assert [outputs[i] for i in ids] == expected
    assert events, "the cache was meant to be too small for all requests at once"
    assert any(mid for _, _, mid, _, _, _ in events)
    for victim, running, _, table, cached, waiting in events:
        assert victim == running[-1], "the most recently admitted request is preempted"
        assert table == [] and cached == 0
        later = [w for w in waiting if ids.index(w) > ids.index(victim)]
        assert waiting.index(victim) < min((waiting.index(w) for w in later), default=99)
    assert engine.kv.allocator.num_used == 0


def test_request_larger_than_the_cache_is_refused(tiny_llama):
    llm = LLM(str(tiny_llama), page_size=4, num_kv_pages=5)  # 16 tokens of KV
    engine = llm.engine
    with pytest.raises(RequestTooLargeError, match="max_tokens") as err:
        engine.add_request([5] * 10, SamplingParams(max_tokens=7))
    assert err.value.field == "max_tokens"
    assert not engine.has_unfinished() and not engine.requests
    rid = engine.add_request([5] * 10, SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert rid not in engine.requests and engine.kv.allocator.num_used == 0


def _step_until(engine, rid, done):
    req = engine.requests[rid]
    for _ in range(100):
        if done(req):
            return req
        engine.step()
    raise AssertionError("condition never reached")


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "mid_decode", "finished"])
def test_no_page_leaked_after_abort_or_finish(tiny_llama, when):
    llm = LLM(str(tiny_llama), page_size=4, max_num_batched_tokens=8, max_num_seqs=1)
    engine = llm.engine
    other = engine.add_request(list(range(3, 20)), GREEDY)
    rid = engine.add_request(list(range(3, 33)), GREEDY)  # 30 tokens: 4 prefill chunks
    if when == "mid_prefill":
        req = _step_until(engine, rid, lambda r: 0 < r.cached_len < 30)
        assert req.page_table
    elif when == "mid_decode":
        req = _step_until(engine, rid, lambda r: 1 < len(r.output_token_ids) < 10)
    elif when == "waiting":
        engine.step()
        assert engine.requests[rid].status is RequestStatus.WAITING
    if when != "finished":
        engine.abort_request(rid)
        assert rid not in engine.requests
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.allocator.num_used == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert other not in engine.requests
    engine.abort_request(rid)  # aborting an unknown or finished id is harmless
    assert engine.kv.allocator.num_used == 0
