"""Scheduler invariants (token budget, chunked prefill, decode-first, preemption, no leaked
pages) on a simulated engine without a model (test_scheduler_engine.py: through the real
engine)."""

from __future__ import annotations

import zlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve import SamplingParams
from specserve.core.kv_cache import KVCache
from specserve.core.request import Request, RequestStatus
from specserve.engine.scheduler import Scheduler
from tests.core.test_kv_cache import tiny_config


def fake_token(req: Request, position: int) -> int:
    """What the simulated model 'samples': a pure function of request and position, so a
    recomputed request must produce the same tokens again."""
    return (zlib.crc32(req.request_id.encode()) * 31 + position * 7) % 1000


class Sim:
    """Drives a Scheduler the way LLMEngine does, without a model, checking invariants."""

    def __init__(self, num_pages, page_size, budget, max_num_seqs=64):
        self.kv = KVCache(tiny_config(1), num_pages, page_size, torch.float32, torch.device("cpu"))
        self.sched = Scheduler(self.kv, max_num_seqs, budget)
        self.budget = budget
        self.arrivals = 0
        self.requests: list[Request] = []
        self.batches: list[list[tuple[Request, int, str]]] = []

    def add(self, prompt_len: int, max_tokens: int, name: str | None = None) -> Request:
        self.arrivals += 1
        req = Request(
            request_id=name or f"r{self.arrivals}",
            prompt_token_ids=list(range(1, prompt_len + 1)),
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            arrival=self.arrivals,
            seed=0,
            max_len=10_000,
            eos_token_ids=frozenset(),
        )
        assert prompt_len + max_tokens <= self.kv.capacity_tokens  # the engine checks this
        self.requests.append(req)
        self.sched.add(req)
        return req

    def step(self) -> list:
        batch = self.sched.schedule()
        kinds = []
        for s in batch:
            req = s.request
            decode = req.output_token_ids and req.num_uncached == 1
            kinds.append((req, s.num_tokens, "decode" if decode else "prefill"))
            assert req.status is RequestStatus.RUNNING
            assert s.num_tokens >= 1
            assert len(req.page_table) >= self.kv.pages_needed(req.cached_len + s.num_tokens)
        self.batches.append(kinds)
        self.check()
        assert sum(s.num_tokens + getattr(s, "draft_len", 0) for s in batch) <= self.budget
        labels = [k for _, _, k in kinds]
        assert labels == sorted(labels), f"a prefill chunk was scheduled before a decode: {labels}"
        assert len({id(s.request) for s in batch}) == len(batch)
        for s in batch:
            s.request.cached_len += s.num_tokens
        for s in batch:
            req = s.request
            if req.cached_len == req.committed_len:
                req.append_token(fake_token(req, req.committed_len))
                if req.finish_reason is not None:
                    self.sched.finish(req)
        self.check()
        return batch

    def check(self) -> None:
        sched, alloc = self.sched, self.kv.allocator
        owned = [p for r in sched.running for p in r.page_table]
        assert len(owned) == len(set(owned)), "a page is shared by two requests"
        assert 0 not in owned
        assert alloc.num_free + len(owned) == alloc.num_usable, "a page leaked"
        assert all(not r.page_table and r.status is RequestStatus.WAITING for r in sched.waiting)
        assert len(sched.running) <= sched.max_num_seqs
        in_queues = {id(r) for r in sched.running} | {id(r) for r in sched.waiting}
        for r in self.requests:
            assert (id(r) in in_queues) != r.finished

    def run(self, max_steps=10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work:
                return
            self.step()
        raise AssertionError("the scheduler made no progress")


def expected_tokens(req: Request) -> list[int]:
    n = len(req.prompt_token_ids)
    return [fake_token(req, n + i) for i in range(req.params.max_tokens)]


@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    spare_pages=st.integers(0, 12),
    budget=st.integers(1, 40),
    max_num_seqs=st.integers(1, 6),
    work=st.lists(
        st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 6)),
        min_size=1,
        max_size=10,
    ),
)
@settings(max_examples=120, deadline=None)
def test_random_workloads_keep_invariants(page_size, spare_pages, budget, max_num_seqs, work):
    """Random arrivals (some mid-run), cache sizes from 'one request barely fits' up, budgets
    from 1 token: every step keeps the invariants; every request ends with exactly its
    max_tokens tokens, recomputed identically after preemption; no page is left owned."""
    need = max(-(-(p + m) // page_size) for p, m, _ in work)
    sim = Sim(1 + need + spare_pages, page_size, budget, max_num_seqs)
    pending = sorted(work, key=lambda w: w[2])
    step = 0
    while pending or sim.sched.has_work:
        while pending and pending[0][2] <= step:
            p, m, _ = pending.pop(0)
            sim.add(p, m)
        if sim.sched.has_work:
            sim.step()
        step += 1
        assert step < 5000
    for req in sim.requests:
        assert req.output_token_ids == expected_tokens(req)
        assert req.finish_reason == "length"
    assert sim.kv.allocator.num_used == 0


def test_budget_and_chunked_prefill():
    sim = Sim(num_pages=64, page_size=4, budget=8)
    long = sim.add(30, 3)
    batch = sim.step()
    assert [(s.request, s.num_tokens) for s in batch] == [(long, 8)]
    assert long.cached_len == 8 and not long.output_token_ids  # no token before the end
    sim.step()
    sim.step()
    assert long.cached_len == 24 and not long.output_token_ids
    batch = sim.step()  # the last 6 prompt tokens; the token after them is sampled
    assert batch[0].num_tokens == 6 and len(long.output_token_ids) == 1
    sim.run()
    assert long.output_token_ids == expected_tokens(long)


def test_decodes_go_before_prefill_chunks():
    sim = Sim(num_pages=64, page_size=4, budget=10)
    a = sim.add(3, 20)
    b = sim.add(4, 20)
    sim.step()  # both prompts fit in one step
    assert len(a.output_token_ids) == len(b.output_token_ids) == 1
    c = sim.add(40, 2)
    batch = sim.step()
    # Both decodes (one token each) first, then 8 tokens of c's prompt.
    assert [(s.request, s.num_tokens) for s in batch] == [(a, 1), (b, 1), (c, 8)]
    d = sim.add(5, 2)
    for _ in range(4):  # c's remaining 32 prompt tokens take the budget left by the decodes
        batch = sim.step()
        assert [(s.request, s.num_tokens) for s in batch] == [(a, 1), (b, 1), (c, 8)]
    assert d.status is RequestStatus.WAITING
    batch = sim.step()  # now c decodes too, and d is admitted with the budget left
    assert [(s.request, s.num_tokens) for s in batch] == [(a, 1), (b, 1), (c, 1), (d, 5)]
    sim.run()


def test_budget_of_one_still_progresses():
    sim = Sim(num_pages=64, page_size=2, budget=1)
    reqs = [sim.add(3, 4), sim.add(2, 3)]
    sim.run()
    assert all(r.output_token_ids == expected_tokens(r) for r in reqs)
    assert all(len(b) == 1 for b in sim.batches)


def test_newest_request_is_preempted_and_requeued_ahead_of_later_arrivals():
    # 4 usable pages of 2 tokens: a and b take two pages each after their first decode.
    sim = Sim(num_pages=5, page_size=2, budget=64)
    a = sim.add(3, 5)
    b = sim.add(3, 5)
    sim.step()  # prefill both: 3 prompt tokens each, one token sampled each
    c = sim.add(2, 1)  # arrives after a and b, waits for pages
    assert sim.sched.num_preemptions == 0
    sim.step()  # a and b each grow to 4 tokens: all 4 pages used
    batch = sim.step()  # a needs a third page: b, the newest running request, is preempted
    assert sim.sched.num_preemptions == 1 and b.num_preemptions == 1
    assert [s.request for s in batch] == [a]
    assert b.status is RequestStatus.WAITING and b.page_table == [] and b.cached_len == 0
    assert list(sim.sched.waiting) == [b, c], "the preempted request must go before c"
    assert len(b.output_token_ids) == 2  # generated tokens are kept and recomputed
    sim.run()
    for r in (a, b, c):
        assert r.output_token_ids == expected_tokens(r)
    # b (arrived before c) was re-admitted no later than c.
    first_seen = {}
    for i, kinds in enumerate(sim.batches[3:]):
        for r, _, _ in kinds:
            first_seen.setdefault(r.request_id, i)
    assert first_seen["r2"] <= first_seen["r3"]


def test_no_admission_beyond_max_num_seqs():
    sim = Sim(num_pages=64, page_size=4, budget=100, max_num_seqs=2)
    reqs = [sim.add(3, 3) for _ in range(5)]
    batch = sim.step()
    assert [s.request for s in batch] == reqs[:2]
    sim.run()
    assert max(len(b) for b in sim.batches) == 2
