"""The scheduler's running counts (penalized, grammar-constrained and min_tokens requests:
what the overlap loop's wait check reads, engine/overlap_wait.py) equal a fresh scan of its
running requests after every admission, preemption, re-admission, finish and abort, and the
wait check that reads them answers as the scan of every row of the step did. The context
count, near the context under an overlapped drive: test_context_count.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from specserve import Grammar, SamplingParams
from specserve.core.kv_cache import KVCache
from specserve.core.request import Request, RequestStatus
from specserve.engine.overlap_wait import RunningCounts, sampling_reason, wait_reason
from specserve.engine.scheduler import Scheduler
from tests.core.test_kv_cache import tiny_config
from tests.support.wait_oracle import scanned_sampling_reason, scanned_wait_reason

MAX_LEN = 10_000

KINDS = {
    "plain": {},
    "penalized": dict(presence_penalty=0.5),
    "repetition": dict(repetition_penalty=1.2),
    "constrained": dict(grammar=Grammar("json")),
    "min_tokens": dict(min_tokens=3),
    "penalized min_tokens": dict(frequency_penalty=0.3, min_tokens=2),
    "penalized constrained": dict(presence_penalty=-0.5, grammar=Grammar("json")),
}


class Driver:
    """Drives a Scheduler as the engine does, without a model (every token 7), with random
    arrivals, early stops and aborts; pages so few that running requests are preempted and
    admitted again."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        kv = KVCache(tiny_config(1), 24, 2, torch.float32, torch.device("cpu"))
        self.sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=20)
        self.arrivals = 0
        self.seen = {"waits": set(), "aborted running": 0, "aborted waiting": 0, "finished": 0}

    def arrive(self) -> None:
        self.arrivals += 1
        kind = self.rng.choice(list(KINDS))
        fields = KINDS[kind]
        max_tokens = self.rng.randint(fields.get("min_tokens", 1), 12)
        params = SamplingParams(max_tokens=max_tokens, **fields)
        prompt_len = self.rng.randint(1, 16)
        self.sched.add(
            Request(
                f"r{self.arrivals}",
                list(range(1, prompt_len + 1)),
                params,
                arrival=self.arrivals,
                seed=0,
                max_len=MAX_LEN,
                eos_token_ids=frozenset(),
            )
        )

    def step(self) -> None:
        sched = self.sched
        batch = sched.schedule()
        self.check()
        prev = SimpleNamespace(
            speculative=self.rng.random() < 0.5, step_input=SimpleNamespace(sampled=[])
        )
        reason = wait_reason(prev, batch, [], sched.counts, None)
        assert reason == scanned_wait_reason(prev, batch)
        late = sampling_reason(prev, batch, sched.counts)
        assert late == scanned_sampling_reason(prev, batch)
        self.seen["waits"].add(reason)
        self.seen["waits"].add(late and f"{late}_before_sampling")
        for s in batch:
            req = s.request
            req.cached_len += s.num_tokens
            if s.samples:
                req.append_token(7)
                if req.finish_reason is not None:
                    sched.finish(req)
                    self.seen["finished"] += 1
        self.check()

    def abort(self) -> None:
        sched = self.sched
        queue = self.rng.choice(["running", "waiting"])
        reqs = list(getattr(sched, queue))
        if reqs:
            req = self.rng.choice(reqs)
            req.finish_reason = "abort"
            sched.finish(req)
            self.seen[f"aborted {queue}"] += 1
            self.check()

    def stop(self) -> None:
        """A running request ends by a stop string (found when its tokens are processed)."""
        running = [r for r in self.sched.running if r.output_token_ids]
        if running:
            req = self.rng.choice(running)
            req.finish_reason = "stop"
            self.sched.finish(req)
            self.seen["finished"] += 1
            self.check()

    def check(self) -> None:
        sched = self.sched
        assert sched.counts == RunningCounts.of(sched.running)
        assert all(r.status is RequestStatus.RUNNING for r in sched.running)

    def run(self, num_actions: int) -> None:
        actions = [self.arrive] * 3 + [self.step] * 6 + [self.abort, self.stop]
        for _ in range(num_actions):
            self.rng.choice(actions)()
        while self.sched.has_work:  # every request ends; the counts end at zero
            self.step()
        assert self.sched.counts == RunningCounts()


@pytest.mark.parametrize("seed", range(4))
def test_running_counts_equal_a_fresh_scan(seed):
    """At every step of a random run (admissions, preemptions and re-admissions, finishes,
    aborts of running and waiting requests, stops), the counts equal a scan of `running`
    and the wait check equals the scan of the step's rows; the run covers every transition
    and every wait reason the counts guard."""
    driver = Driver(seed)
    driver.run(600)
    seen = driver.seen
    assert driver.sched.num_preemptions > 0
    assert seen["aborted running"] and seen["aborted waiting"] and seen["finished"]
    waits = {"penalties_before_sampling", "grammar_before_sampling", "min_tokens_before_sampling"}
    waits.add(None)
    assert waits <= seen["waits"]


def test_only_decoding_constrained_rows_wait_and_min_tokens_by_its_count():
    """The rules the counts must not change: a constrained request waits only once it
    decodes (its prefill rows have no mask); min_tokens only after a speculative step and
    while fewer than min_tokens tokens are generated."""
    kv = KVCache(tiny_config(1), 64, 4, torch.float32, torch.device("cpu"))
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    constrained = Request(
        "c", [1, 2, 3], SamplingParams(grammar=Grammar("json")), 0, 0, MAX_LEN, frozenset()
    )
    sched.add(constrained)
    speculative = SimpleNamespace(speculative=True, step_input=SimpleNamespace(sampled=[]))
    batch = sched.schedule()  # its prompt: no mask yet
    assert sched.counts == RunningCounts(constrained=1)
    assert wait_reason(speculative, batch, [], sched.counts, None) is None
    assert sampling_reason(speculative, batch, sched.counts) is None
    constrained.cached_len += 3
    constrained.append_token(7)
    batch = sched.schedule()
    assert wait_reason(speculative, batch, [], sched.counts, None) is None  # launched first
    assert sampling_reason(speculative, batch, sched.counts) == "grammar"
    constrained.finish_reason = "abort"
    sched.finish(constrained)
    assert sched.counts == RunningCounts()

    req = Request("m", [1, 2], SamplingParams(min_tokens=2), 1, 0, MAX_LEN, frozenset())
    sched.add(req)
    plain = SimpleNamespace(speculative=False, step_input=SimpleNamespace(sampled=[]))
    for generated in range(3):
        batch = sched.schedule()
        assert req.num_generated == generated
        assert sampling_reason(plain, batch, sched.counts) is None
        expected = "min_tokens" if generated < 2 else None
        assert sampling_reason(speculative, batch, sched.counts) == expected
        assert wait_reason(speculative, batch, [], sched.counts, None) is None
        req.cached_len += batch[0].num_tokens
        req.append_token(7)
    assert sched.counts == RunningCounts(min_tokens=1)  # counted until it leaves
