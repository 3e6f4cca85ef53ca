"""Speculation takes what scheduling leaves: drafts get the step's token budget after every
committed token, prefill chunk and admission, pages only from the free ones and none while a
waiting request lacks pages; the policy is told what the step carries (`StepLoad`)."""

from __future__ import annotations

import torch

from specserve import SamplingParams
from specserve.core.kv_cache import KVCache
from specserve.core.request import Request
from specserve.engine.scheduler import Scheduler
from specserve.speculative.policy import NO_LOAD, FixedPolicy, SpeculationPolicy
from tests.core.test_kv_cache import tiny_config


class Recording(FixedPolicy):
    """Fixed K_max (within the budget), remembering every StepLoad it was given."""

    def __init__(self, k_max: int):
        super().__init__(k_max)
        self.loads = []

    def choose(self, reqs, load=NO_LOAD):
        self.loads.append((len(reqs), load))
        return super().choose(reqs, load)


def _sched(num_pages: int, page_size: int, budget: int, max_num_seqs: int = 16) -> Scheduler:
    kv = KVCache(tiny_config(1), num_pages, page_size, torch.float32, torch.device("cpu"))
    return Scheduler(kv, max_num_seqs, budget)


def _request(i: int, prompt_len: int, max_tokens: int = 50) -> Request:
    return Request(
        f"r{i}",
        list(range(1, prompt_len + 1)),
        SamplingParams(max_tokens=max_tokens, temperature=0.0),
        arrival=i,
        seed=0,
        max_len=10_000,
        eos_token_ids=frozenset(),
    )


def _run_step(sched: Scheduler, policy: SpeculationPolicy | None = None):
    """One scheduled step as the engine commits it (every draft rejected)."""
    batch = sched.schedule(policy)
    for s in batch:
        samples = s.samples
        s.request.cached_len += s.num_tokens
        if samples:
            s.request.append_token(7)
    return batch


def _decoding(sched: Scheduler, n: int, prompt_len: int = 4) -> list[Request]:
    reqs = [_request(i, prompt_len) for i in range(n)]
    for r in reqs:
        sched.add(r)
    _run_step(sched)  # every prompt prefilled: all decode from now on
    return reqs


def test_drafts_take_the_budget_admissions_leave():
    sched = _sched(num_pages=200, page_size=4, budget=20)
    _decoding(sched, 4)
    sched.add(_request(9, prompt_len=12))
    policy = Recording(k_max=3)
    batch = sched.schedule(policy)
    # 4 decode tokens + a 12-token prompt leave 4 tokens: one draft each, not three
    assert [(s.num_tokens, s.draft_len) for s in batch] == [(1, 1)] * 4 + [(12, 0)]
    n, load = policy.loads[-1]
    assert n == 4 and load.prefill_tokens == 12 and load.draft_budget == 4
    assert load.prefill_per_token == 0.0  # nothing finished yet


def test_decode_and_verify_rows_lead_the_step():
    # running order puts a prefilling request first (a preempted one re-admitted ahead, say):
    # the step still leads with the decoding request, the attention backend's split needs it
    sched = _sched(num_pages=200, page_size=4, budget=64)
    (decoding,) = _decoding(sched, 1)
    prefilling = _request(5, prompt_len=20)
    sched.kv.grow(prefilling.page_table, 8)
    prefilling.cached_len = 8
    sched.running.insert(0, prefilling)
    batch = sched.schedule(Recording(k_max=2))
    assert [(s.request, s.decoding, s.draft_len) for s in batch] == [
        (decoding, True, 2),
        (prefilling, False, 0),
    ]


def test_a_request_waiting_for_pages_gets_them_before_any_lookahead():
    # pages of 4 tokens; two requests of 6 prompt tokens + 1 generated hold 2 pages each
    # (positions 0..7) and decode at position 6: K=3 would need a third page each
    def two_decoding(extra_prompt: int | None):
        sched = _sched(num_pages=1 + 4 + 3, page_size=4, budget=100)
        reqs = _decoding(sched, 2, prompt_len=6)
        assert [len(r.page_table) for r in reqs] == [2, 2]
        if extra_prompt is not None:
            sched.add(_request(9, prompt_len=extra_prompt))
        return sched, sched.schedule(Recording(k_max=3))

    sched, batch = two_decoding(12)  # admitted: takes the 3 free pages
    assert [s.request.request_id for s in batch] == ["r0", "r1", "r9"]
    assert [s.draft_len for s in batch[:2]] == [1, 1]  # what their 2 pages cover (7)
    assert sched.kv.allocator.num_free == 0
    sched, batch = two_decoding(16)  # needs 4 pages: it waits, and they stay free for it
    assert [s.draft_len for s in batch] == [1, 1] and sched.kv.allocator.num_free == 3
    sched, batch = two_decoding(None)  # nobody waits: the lookahead takes free pages
    assert [s.draft_len for s in batch] == [3, 3] and sched.kv.allocator.num_free == 1


def test_short_of_pages_every_request_drafts_as_few():
    # one request's pages cover K=3 (positions 5..8 on its 3rd page), the other's only K=1:
    # while a prompt waits for pages both draft 1 (one length: the step need not wait)
    sched = _sched(num_pages=1 + 5 + 2, page_size=4, budget=100)
    roomy, tight = _decoding(sched, 2, prompt_len=6)
    sched.kv.grow(roomy.page_table, 12)  # 3 pages: positions 0..11
    sched.add(_request(9, prompt_len=16))  # 4 pages: it cannot be admitted
    batch = sched.schedule(Recording(k_max=3))
    assert [s.draft_len for s in batch] == [1, 1]


def test_the_policy_learns_the_prefill_per_token():
    sched = _sched(num_pages=400, page_size=4, budget=64, max_num_seqs=2)
    for i in range(2):
        sched.add(_request(i, prompt_len=10, max_tokens=5))
    while sched.running or sched.waiting:  # prompts of 10, outputs of 5
        for s in _run_step(sched):
            if s.request.finish_reason is not None:
                sched.finish(s.request)
    assert sched.prefill_per_token == 2.0
    for i in range(2, 5):  # 3 requests, 2 sequence slots: one waits
        sched.add(_request(i, prompt_len=10))
    _run_step(sched)
    policy = Recording(k_max=3)
    sched.schedule(policy)
    assert policy.loads[-1][1].prefill_per_token == 2.0
    # an aborted request's lengths say nothing about the requests to come
    aborted = sched.running[0]
    aborted.finish_reason = "abort"
    sched.finish(aborted)
    assert sched.prefill_per_token == 2.0


def test_the_policy_is_told_the_servers_occupancy():
    """`StepLoad.occupancy`: the running requests over the server's room, its sequence
    slots or the requests of the finished ones' mean length its KV cache holds, whichever is
    fewer (1.0 until one finished)."""
    # 400 pages of 4 = 1,600 tokens; finished requests of 10 + 5 tokens: room for 106 by
    # the KV cache, 16 by the sequence slots
    sched = _sched(num_pages=400, page_size=4, budget=256, max_num_seqs=16)
    assert sched.occupancy == 1.0  # nothing finished: no room known
    sched.add(_request(0, prompt_len=10, max_tokens=5))
    while sched.running or sched.waiting:
        for s in _run_step(sched):
            if s.request.finish_reason is not None:
                sched.finish(s.request)
    assert sched.occupancy == 0.0
    for i in range(1, 5):
        sched.add(_request(i, prompt_len=10))
    _run_step(sched)
    assert sched.occupancy == 4 / 16
    policy = Recording(k_max=3)
    sched.schedule(policy)
    assert policy.loads[-1][1].occupancy == 4 / 16
    # where the KV cache holds fewer requests than there are slots, it is the room
    small = _sched(num_pages=16, page_size=4, budget=256, max_num_seqs=16)  # 60 usable tokens
    small.add(_request(0, prompt_len=10, max_tokens=5))
    while small.running or small.waiting:
        for s in _run_step(small):
            if s.request.finish_reason is not None:
                small.finish(s.request)
    for i in range(1, 3):
        small.add(_request(i, prompt_len=10, max_tokens=5))
    _run_step(small)
    room = small.kv.capacity_tokens / 15
    assert room < 16 and small.occupancy == min(1.0, 2 / room)


def test_the_policy_is_told_who_waits_for_budget_or_pages_not_for_a_slot():
    """`StepLoad.waiting`: requests left waiting after the step's admissions for budget or
    pages (the goodput policy does not wake its drafter for them), none when what they wait
    for is a sequence slot (which drafts do not take)."""
    sched = _sched(num_pages=200, page_size=4, budget=20)
    _decoding(sched, 4)
    for i in range(3):
        sched.add(_request(10 + i, prompt_len=12))
    policy = Recording(k_max=3)
    sched.schedule(policy)  # a prompt and a chunk of the next fill the budget: one waits
    assert policy.loads[-1][1].waiting == 1
    assert policy.loads[-1][1].after_idle  # the first step decoding since nothing ran
    sched.schedule(policy)
    assert not policy.loads[-1][1].after_idle
    # every request gone, new ones come: a step of prefill only keeps the mark for the
    # first step that decodes
    for r in list(sched.running):
        sched.finish(r)
    sched.add(_request(20, prompt_len=60))
    _run_step(sched, policy)
    assert policy.loads[-1] == (0, policy.loads[-1][1])  # (prefill only: nothing decodes)
    _run_step(sched, policy)
    assert policy.loads[-1][0] == 1 and policy.loads[-1][1].after_idle
    _run_step(sched, policy)
    assert not policy.loads[-1][1].after_idle
    sched = _sched(num_pages=200, page_size=4, budget=64, max_num_seqs=4)
    _decoding(sched, 4)
    sched.add(_request(9, prompt_len=4))
    sched.schedule(policy)  # it waits for a slot: budget and pages are there
    assert policy.loads[-1][1].waiting == 0 and len(sched.waiting) == 1


def test_the_caps_are_set_only_for_a_policy_that_reads_them():
    """`max_useful_drafts` is set for every decoding request only where the policy says its
    next choice reads it (`reads_caps`: not a held decision for plain decoding)."""

    class Plain(Recording):
        reads = True

        def reads_caps(self, load):
            return self.reads

    sched = _sched(num_pages=200, page_size=4, budget=64)
    reqs = _decoding(sched, 3)
    policy = Plain(k_max=3)
    for r in reqs:
        r.max_useful_drafts = -7
    _run_step(sched, policy)
    assert [r.max_useful_drafts for r in reqs] == [48] * 3  # (49 of 50 left, one this step's)
    policy.reads = False
    for r in reqs:
        r.max_useful_drafts = -7
    _run_step(sched, policy)
    assert [r.max_useful_drafts for r in reqs] == [-7] * 3


def test_the_schedule_says_whether_it_gave_any_draft_length():
    """`drafted`: whether the last schedule gave any request a draft length (the step loop
    runs no proposer pass without one while the drafter is dormant): not without a policy,
    nor where the policy chose plain decoding or the budget left no drafts."""

    class Plain(Recording):
        def choose(self, reqs, load=NO_LOAD):
            self.loads.append((len(reqs), load))
            return self._decided([0] * len(reqs))

    sched = _sched(num_pages=200, page_size=4, budget=64)
    _decoding(sched, 3)
    assert not sched.drafted
    _run_step(sched, Recording(k_max=3))
    assert sched.drafted
    _run_step(sched, Plain(k_max=3))
    assert not sched.drafted
    _run_step(sched, Recording(k_max=3))
    _run_step(sched)
    assert not sched.drafted
    tight = _sched(num_pages=200, page_size=4, budget=3)
    _decoding(tight, 3, prompt_len=1)
    batch = _run_step(tight, Recording(k_max=3))  # 3 decode tokens take the budget
    assert [s.draft_len for s in batch] == [0] * 3 and not tight.drafted
