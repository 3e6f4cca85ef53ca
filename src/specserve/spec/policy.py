"""Speculation policies: each step, a draft length (0..K_max) for every decoding request.

- off: never speculate (the plain decode path runs);
- fixed: K_max every step;
- schedule: a user table from batch size to K (the form other servers offer);
- goodput: maximize expected committed tokens per second of the step under a measured cost
  model and per-request acceptance estimates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.engine.request import Request
from specserve.spec.acceptance import AcceptanceModel
from specserve.spec.cost_model import StepCostModel

POLICIES = ("off", "fixed", "schedule", "goodput")


@dataclass
class PolicyTrace:
    """What the policy decided and how it turned out (exported as metrics)."""

    steps_by_draft_len: list[int] = field(default_factory=list)  # request-steps per K
    last_draft_lens: list[int] = field(default_factory=list)
    predicted_goodput: float = 0.0  # tokens/s the policy expected of the last step
    observed_goodput: float = 0.0  # tokens/s the last step delivered

    def record(self, draft_lens: list[int]) -> None:
        self.last_draft_lens = list(draft_lens)
        for k in draft_lens:
            while len(self.steps_by_draft_len) <= k:
                self.steps_by_draft_len.append(0)
            self.steps_by_draft_len[k] += 1


class SpeculationPolicy(ABC):
    """Chooses draft lengths for the decoding requests of a step."""

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.trace = PolicyTrace()
        self.predicted_tokens = 0.0
        self.predicted_ms = 0.0

    @abstractmethod
    def choose(self, reqs: list[Request], extra_tokens: int = 0) -> list[int]:
        """Draft lengths for `reqs`; `extra_tokens` counts prefill tokens sharing the step."""


class OffPolicy(SpeculationPolicy):
    def choose(self, reqs, extra_tokens=0):
        return [0] * len(reqs)


class FixedPolicy(SpeculationPolicy):
    def choose(self, reqs, extra_tokens=0):
        return [self.k_max] * len(reqs)


class SchedulePolicy(SpeculationPolicy):
    """`table` like "1:4,16:2,64:0": from batch size 1 use K=4, from 16 K=2, from 64 off."""

    def __init__(self, k_max: int, table: str):
        super().__init__(k_max)
        try:
            pairs = sorted((int(b), int(k)) for b, k in (e.split(":") for e in table.split(",")))
        except ValueError:
            raise ValueError(
                f"speculative schedule {table!r} must look like '1:4,16:2,64:0' "
                "(batch size:draft length, comma separated)"
            ) from None
        self.table = [(b, min(k, k_max)) for b, k in pairs]

    def choose(self, reqs, extra_tokens=0):
        k = 0
        for min_batch, table_k in self.table:
            if len(reqs) >= min_batch:
                k = table_k
        return [k] * len(reqs)


class PerRequestPolicy(SpeculationPolicy):
    """Draft lengths from a function of the request (tests force arbitrary switching)."""

    def __init__(self, k_max: int, fn: Callable[[Request], int]):
        super().__init__(k_max)
        self.fn = fn

    def choose(self, reqs, extra_tokens=0):
        return [self.fn(r) for r in reqs]


class GoodputPolicy(SpeculationPolicy):
    """Maximizes sum_r E[tokens_r(k_r)] / step_ms(k).

    Each extra draft of request r at depth j adds prod_{i<=j} alpha_r[i] expected tokens and
    one token to the verify pass (plus drafter work). Increments are taken in order of their
    expected gain; the best prefix of that order, and every uniform K, are evaluated under
    the cost model and the best one wins (so it never does worse than any fixed K under the
    model, K=0 included).
    """

    PROBE_EVERY = 32  # steps short of full depth before a full-depth probe
    PROBE_MIN_ALPHA = 0.1  # no probe once a request's first-draft acceptance is below this

    def __init__(self, k_max: int, cost: StepCostModel, acceptance: AcceptanceModel):
        super().__init__(k_max)
        self.cost = cost
        self.acceptance = acceptance
        self._idle: dict[str, int] = {}  # steps since each request drafted at full depth

    def choose(self, reqs, extra_tokens=0):
        n = len(reqs)
        if n == 0:
            return []
        alphas = [self.acceptance.alpha(r.request_id) for r in reqs]
        caps = [min(self.k_max, r.max_useful_drafts) for r in reqs]
        base = n + extra_tokens

        def evaluate(ks: list[int]) -> tuple[float, float, float]:
            tokens = float(n)
            for a, k in zip(alphas, ks):
                run = 1.0
                for x in a[:k]:
                    run *= x
                    tokens += run
            ms = self.cost.step_ms(base + sum(ks), ks)
            return tokens / ms, tokens, ms

        best_ks = [0] * n
        best = evaluate(best_ks)
        for k in range(1, self.k_max + 1):
            ks = [min(k, c) for c in caps]
            score = evaluate(ks)
            if score[0] > best[0]:
                best, best_ks = score, ks
        # Greedy by marginal gain, incremental in tokens, time and drafter batch counts.
        increments = []
        for r, (a, cap) in enumerate(zip(alphas, caps)):
            run = 1.0
            for j in range(cap):
                run *= a[j]
                increments.append((-run, j, r))
        increments.sort()
        ks = [0] * n
        counts = [0] * self.k_max
        tokens, extra = float(n), 0
        drafter = self.cost.drafter
        draft_ms = 0.0
        for neg_gain, j, r in increments:
            ks[r] = j + 1
            tokens -= neg_gain
            extra += 1
            if drafter is not None:
                draft_ms += drafter(counts[j] + 1) - drafter(counts[j])
            counts[j] += 1
            ms = self.cost.target(base + extra) + draft_ms
            if tokens / ms > best[0]:
                best, best_ks = (tokens / ms, tokens, ms), list(ks)
        self.predicted_tokens, self.predicted_ms = best[1], best[2]
        return self._probe(reqs, alphas, caps, best_ks)

    def _probe(self, reqs, alphas, caps, ks: list[int]) -> list[int]:
        """Acceptance is only observed at the depths drafted: a request that has not drafted
        at full depth for PROBE_EVERY steps does so once (every position's estimate is
        refreshed), unless its first drafts have proven useless, so a pessimistic estimate
        cannot keep speculation shallow or off for good."""
        idle = {}
        for i, r in enumerate(reqs):
            n = 0 if ks[i] >= caps[i] else self._idle.get(r.request_id, 0) + 1
            if n >= self.PROBE_EVERY and caps[i] and alphas[i][0] >= self.PROBE_MIN_ALPHA:
                ks[i], n = caps[i], 0
            idle[r.request_id] = n
        self._idle = idle
        return ks
