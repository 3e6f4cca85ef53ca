"""The overlap loop's context check (engine/overlap_wait.py) scans a step's rows only while
a running request may reach past the context (`RunningCounts.near_context`, by
`max_reach`): driven as the overlap loop drives the scheduler (the step in flight counted as
one token, its drafts moving the next step's rows, waits settling the batch), near a small
context, the count equals a fresh scan of the running requests, every row stays within its
request's `max_reach`, and the wait check answers as the full scan of every row did."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from specserve import SamplingParams
from specserve.core.kv_cache import KVCache
from specserve.core.request import Request
from specserve.engine.overlap_wait import RunningCounts, max_reach, settle, wait_reason
from specserve.engine.scheduler import Scheduler
from specserve.speculative.policy import NO_LOAD, FixedPolicy, SpeculationPolicy
from tests.core.test_kv_cache import tiny_config
from tests.engine.test_running_counts import KINDS
from tests.support.wait_oracle import scanned_wait_reason

CONTEXT = 40


class RisingK(SpeculationPolicy):
    """Draft lengths up to a K that rises through the run (the scheduler's draft bound grows
    while requests run), one for the step or one per request."""

    def __init__(self, k_max: int, rng: random.Random):
        super().__init__(k_max)
        self.rng, self.steps = rng, 0

    def choose(self, reqs, load=NO_LOAD):
        self.steps += 1
        k = min(self.k_max, 1 + self.steps // 40)
        if self.rng.random() < 0.5:
            return [self.rng.randint(0, k)] * len(reqs)
        return [self.rng.randint(0, k) for _ in reqs]


class OverlapDriver:
    """Drives a Scheduler as the overlap loop does (engine/step_loop.py), without a model:
    every token 7, a random number of each request's drafts accepted (all of them with
    `accept_all`), random arrivals near the context, stops and aborts; so few pages that
    running requests are preempted, also while a step of theirs is in flight."""

    def __init__(self, seed: int, policy=None, accept_all: bool = False):
        self.rng = random.Random(seed)
        kv = KVCache(tiny_config(1), 36, 4, torch.float32, torch.device("cpu"))
        self.sched = Scheduler(kv, 6, 24, max_model_len=CONTEXT)
        self.policy = policy or RisingK(4, self.rng)
        self.accept_all = accept_all
        self.inflight = None
        self.arrivals = 0
        self.seen = {"scanned": 0, "skipped": 0, "reasons": set(), "raised while running": 0}
        self.furthest = 0  # the furthest a row reached (committed, moved and drafted)

    def arrive(self, prompt_len=None, max_tokens=None, fields=None) -> Request:
        """A request of a random kind (plain mostly), prompt length and max_tokens, unless
        given."""
        rng = self.rng
        self.arrivals += 1
        if fields is None:
            fields = KINDS[rng.choice(list(KINDS))] if rng.random() < 0.2 else {}
        prompt_len = prompt_len or rng.randint(1, CONTEXT - 1)
        if max_tokens is None:  # short, up to the context (the server's default), past it
            max_tokens = rng.choice(
                [rng.randint(1, 12), CONTEXT - prompt_len, rng.randint(1, 2 * CONTEXT)]
            )
        min_tokens = min(fields.get("min_tokens", 0), max_tokens)
        params = SamplingParams(max_tokens=max_tokens, **{**fields, "min_tokens": min_tokens})
        req = Request(
            f"r{self.arrivals}",
            [1 + i % 15 for i in range(prompt_len)],
            params,
            arrival=self.arrivals,
            seed=0,
            max_len=CONTEXT,
            eos_token_ids=frozenset(),
        )
        self.sched.add(req)
        return req

    def step(self) -> str | None:
        sched, prev = self.sched, self.inflight
        max_drafts, running = sched.counts.max_drafts, bool(sched.running)
        batch = sched.schedule(self.policy)
        if sched.counts.max_drafts > max_drafts and running:
            self.seen["raised while running"] += 1
        self.check()
        reason = None
        if prev is not None:
            counts = sched.counts
            moved = {id(s.request): s.drafted for s in prev.step_input.sampled}
            for s in batch:  # the bound the count rests on
                reach = s.request.committed_len + moved.get(id(s.request), 0) + s.draft_len
                assert reach <= max_reach(s.request, counts.max_drafts)
                self.furthest = max(self.furthest, reach)
            reason = wait_reason(prev, batch, [], counts, None)
            assert reason == scanned_wait_reason(prev, batch, CONTEXT)
            if prev.speculative and reason in (None, "context_limit"):
                self.seen["scanned" if counts.near_context else "skipped"] += 1
            self.seen["reasons"].add(reason)
            if reason is not None:  # wait for prev's tokens, then settle
                self._resolve(prev)
                batch = settle(batch)
        self.inflight = self._launch(batch) if batch else None
        if prev is not None:
            self._process(prev)
        self.check()
        return reason

    def _launch(self, batch):
        sampled = [s for s in batch if s.samples]
        for s in batch:
            s.request.cached_len += s.num_tokens
        for s in sampled:
            s.drafts = [7] * s.draft_len
            s.request.num_inflight += 1
            s.request.num_inflight_drafts += s.drafted
        return SimpleNamespace(
            step_input=SimpleNamespace(sampled=sampled),
            speculative=any(s.drafted for s in batch),
            preemptions=[s.request.num_preemptions for s in sampled],
            tokens=None,
        )

    def _resolve(self, step) -> None:
        if step.tokens is not None:
            return
        step.tokens = []
        for s, preemptions in zip(step.step_input.sampled, step.preemptions):
            req = s.request
            req.num_inflight -= 1
            req.num_inflight_drafts -= s.drafted
            accepted = s.drafted if self.accept_all else self.rng.randint(0, s.drafted)
            step.tokens.append([7] * (accepted + 1))
            if req.finished:
                continue
            if req.num_preemptions == preemptions:
                req.cached_len += accepted
            req.unprocessed_token_ids = step.tokens[-1]

    def _process(self, step) -> None:
        self._resolve(step)
        for s, tokens in zip(step.step_input.sampled, step.tokens):
            req = s.request
            if req.finished:
                continue
            req.unprocessed_token_ids = []
            for token in tokens:
                req.append_token(token)
                if req.finish_reason is not None:
                    self.sched.finish(req)
                    break

    def leave(self) -> None:
        """A running or waiting request is aborted, or a running one ends by a stop string."""
        sched = self.sched
        reqs = list(sched.running) + list(sched.waiting)
        if reqs:
            req = self.rng.choice(reqs)
            req.finish_reason = "abort" if self.rng.random() < 0.5 else "stop"
            sched.finish(req)
            self.check()

    def check(self) -> None:
        sched = self.sched
        counts = sched.counts
        assert counts == RunningCounts.of(sched.running, CONTEXT, counts.max_drafts)

    def run(self, num_actions: int) -> None:
        actions = [self.arrive] * 3 + [self.step] * 8 + [self.leave]
        for _ in range(num_actions):
            self.rng.choice(actions)()
        while self.sched.has_work or self.inflight is not None:
            self.step()
        assert self.sched.counts == RunningCounts(max_model_len=CONTEXT, max_drafts=4)


@pytest.mark.parametrize("seed", range(6))
def test_context_count_equals_a_fresh_scan_near_the_context(seed):
    """At every step of a random overlapped run near a 40-token context, the counts equal a
    scan of `running`, no row passes its request's `max_reach` and the wait check equals the
    full scan; the run takes the skip (a speculative step in flight, nothing near the
    context), the scan, and the context wait."""
    driver = OverlapDriver(seed)
    driver.run(800)
    seen = driver.seen
    assert driver.sched.num_preemptions > 0 and seen["raised while running"] > 0
    assert seen["skipped"] > 0 and seen["scanned"] > 0
    assert {None, "context_limit"} <= seen["reasons"]


def test_max_reach_is_reached():
    """The bound is tight: with K=3, a request whose output may end 2K - 2 tokens short of
    the context is counted and its row does pass the context (its last row's drafts on top
    of the step in flight's, all accepted); one that ends a token sooner is not counted and
    never waits."""
    driver = OverlapDriver(0, FixedPolicy(3), accept_all=True)
    driver.step()  # nothing to run
    # Every step commits 4 tokens: its committed length at scheduling runs 15, 19, ..., 35,
    # its last (36 ends it), where 3 drafts on 3 in flight reach 41.
    counted = driver.arrive(13, CONTEXT - 13 - 4, {})
    assert max_reach(counted, 3) == CONTEXT + 1
    driver.step()  # its prompt: no drafts yet
    assert driver.sched.counts.max_drafts == 0 and driver.sched.counts.near_context == 0
    reasons = [driver.step() for _ in range(12)]
    assert driver.sched.counts.max_drafts == 3 and counted.finished
    assert reasons.count("context_limit") == 1

    driver = OverlapDriver(0, FixedPolicy(3), accept_all=True)
    uncounted = driver.arrive(13, CONTEXT - 13 - 5, {})
    assert max_reach(uncounted, 3) == CONTEXT
    reasons = [driver.step() for _ in range(12)]
    assert uncounted.finished and set(reasons) == {None}
    assert driver.sched.counts == RunningCounts(max_model_len=CONTEXT, max_drafts=3)


def test_one_draft_a_step_never_passes_the_context():
    """With at most one draft a step a row ends at most at the context (drafts are capped to
    end inside it), so no request is counted however long its output may grow."""
    driver = OverlapDriver(1, FixedPolicy(1), accept_all=True)
    for _ in range(4):
        driver.arrive(max_tokens=CONTEXT, fields={})
    for _ in range(30):
        assert driver.step() is None
        assert driver.sched.counts.near_context == 0
    assert driver.sched.counts.max_drafts == 1 and driver.furthest == CONTEXT
