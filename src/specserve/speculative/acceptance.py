"""Acceptance estimates: per-request, per-draft-position, exponentially weighted, with the
global estimate as the prior of every request (and what its own evidence fades back to while
it does not draft)."""

from __future__ import annotations

from collections.abc import Iterable


def cumulative_tokens(alpha: list[float]) -> list[float]:
    """[E tokens at k drafts for k = 0..len(alpha)]: 1 (the bonus) + sum_j prod_{i<=j} a_i."""
    out, total, run = [1.0], 1.0, 1.0
    for a in alpha:
        run *= a
        total += run
        out.append(total)
    return out


class AcceptanceModel:
    """alpha[j] estimates P(draft j+1 accepted | drafts 1..j accepted).

    Decayed counts: each verify step adds (accepted, drafted) at every position it observed,
    older counts fade by `decay` per observation (a window of about 20 verify steps per
    request). A request's estimate adds REQUEST_PRIOR_WEIGHT pseudo-observations at the
    global rate: requests differ (a head's per-prompt rates spread by about 0.15 around
    its mean, a Beta prior of about 8 observations), so one or two rejections must not turn
    speculation off (on the H200, with a prior of 2, one rejected first draft sent a
    request to plain decoding for a hundred steps, though it accepted 80-90% later on).

    While a request does not draft nothing new is observed, and acceptance drifts along a
    text (a hard opening, a hard passage): its own evidence fades by IDLE_DECAY per step (the
    policy's clock, `tick()`) once IDLE_GRACE steps pass without an update, so an estimate
    that stopped drafting returns to the global one and drafting is tried again. Estimates
    are computed when read (with the global estimate of then) and cached until the request's
    next verify step or the next IDLE_QUANTUM idle steps (a verify step leaves only the prior
    it used: the estimate is computed at the next read, and most steps read none: fixed K,
    held decisions). The global estimate follows every verify step over a longer window,
    from PRIOR_WEIGHT observations at `prior`.
    """

    PRIOR_WEIGHT = 2.0
    REQUEST_PRIOR_WEIGHT = 8.0
    IDLE_DECAY = 0.97  # about 23 steps without drafting halve a request's own evidence
    IDLE_GRACE = 4
    IDLE_QUANTUM = 8

    def __init__(
        self, k_max: int, prior: float = 0.6, decay: float = 0.95, global_decay: float = 0.995
    ):
        self.k_max = k_max
        self.prior = prior
        self.decay = decay
        self.global_decay = global_decay
        self.steps = 0  # the policy's clock (`tick`)
        self._global_hits = [0.0] * k_max
        self._global_seen = [0.0] * k_max
        self._version = 0  # changes with the global estimate
        self._global: tuple | None = None  # (alpha, cumulative, version)
        self._per_request: dict[str, tuple[list[float], list[float]]] = {}
        self._updated: dict[str, int] = {}  # request -> clock at its last verify step
        # request -> (alpha, cumulative, clock until which they hold), or, after a verify
        # step, (None, the prior it used, clock) until read (`_fill`)
        self._cache: dict[str, tuple[list[float] | None, list[float], int]] = {}
        self.position_drafted = [0] * k_max
        self.position_accepted = [0] * k_max

    def tick(self) -> None:
        """One step of the policy's clock (a decode step was decided)."""
        self.steps += 1

    def _global_entry(self) -> tuple:
        if self._global is None or self._global[2] != self._version:
            m = self.PRIOR_WEIGHT
            alpha = [
                (h + m * self.prior) / (n + m) for h, n in zip(self._global_hits, self._global_seen)
            ]
            self._global = (alpha, cumulative_tokens(alpha), self._version)
        return self._global

    @property
    def global_alpha(self) -> list[float]:
        return self._global_entry()[0]

    def has_observations(self, request_id: str) -> bool:
        """Whether the request has verified drafts (else its estimate is the global one)."""
        return request_id in self._per_request

    def _refresh(self, request_id: str) -> tuple:
        """(alpha, cumulative tokens, clock until which they hold) of a request, cached."""
        counts = self._per_request.get(request_id)
        if counts is None:
            return self._global_entry()
        updated = self._updated[request_id]
        idle = self.steps - updated - self.IDLE_GRACE
        m, prior = self.REQUEST_PRIOR_WEIGHT, self._global_entry()[0]
        faded = 0 if idle < self.IDLE_QUANTUM else idle - idle % self.IDLE_QUANTUM
        f = self.IDLE_DECAY**faded
        alpha, cum, total, run = [], [1.0], 1.0, 1.0  # (cumulative_tokens, inlined)
        for h, n, g in zip(*counts, prior):
            a = (h * f + m * g) / (n * f + m)
            alpha.append(a)
            run *= a
            total += run
            cum.append(total)
        until = updated + self.IDLE_GRACE + faded + self.IDLE_QUANTUM
        entry = self._cache[request_id] = (alpha, cum, until)
        return entry

    def _fill(self, request_id: str, entry: tuple) -> tuple:
        """The estimate a verify step left for its next read: its counts over the prior it
        used (`update_many`)."""
        _, prior, until = entry
        hits, seen = self._per_request[request_id]
        m = self.REQUEST_PRIOR_WEIGHT
        alpha, cum, total, run = [], [1.0], 1.0, 1.0  # (cumulative_tokens, inlined)
        for h, n, g in zip(hits, seen, prior):
            a = (h + m * g) / (n + m)
            alpha.append(a)
            run *= a
            total += run
            cum.append(total)
        entry = self._cache[request_id] = (alpha, cum, until)
        return entry

    def _entry(self, request_id: str) -> tuple:
        entry = self._cache.get(request_id)
        if entry is None or self.steps >= entry[2]:
            return self._refresh(request_id)
        return entry if entry[0] is not None else self._fill(request_id, entry)

    def alpha(self, request_id: str) -> list[float]:
        return self._entry(request_id)[0]

    def cumulative(self, request_id: str) -> list[float]:
        """`cumulative_tokens(alpha(request_id))`, cached (the policy reads it for every
        request every step)."""
        return self._entry(request_id)[1]

    def cumulatives(self, request_ids: Iterable[str]) -> list[list[float]]:
        """`cumulative` of each request (the policy reads every decoding request's when it
        deliberates: requests without evidence of their own, those admitted while nothing
        drafted, share the global estimate's list)."""
        cache, steps, out = self._cache, self.steps, []
        per_request, shared = self._per_request, None
        for request_id in request_ids:
            entry = cache.get(request_id)
            if entry is None or steps >= entry[2]:
                if request_id not in per_request:
                    if shared is None:
                        shared = self._global_entry()[1]
                    out.append(shared)
                    continue
                entry = self._refresh(request_id)
            elif entry[0] is None:
                entry = self._fill(request_id, entry)
            out.append(entry[1])
        return out

    def update(self, request_id: str, drafted: int, accepted: int) -> None:
        """Record a verify step: positions 1..accepted accepted, accepted+1 rejected."""
        self.update_many([(request_id, drafted, accepted)])

    def update_many(self, steps: list[tuple[str, int, int]]) -> None:
        """Record one engine step's verify results, (request_id, drafted, accepted) each;
        every request's prior is the global estimate before the step."""
        if not steps:
            return
        prior = self._global_entry()[0]
        until = self.steps + self.IDLE_GRACE + self.IDLE_QUANTUM
        cache, updated = self._cache, self._updated
        k_max, d, gd = self.k_max, self.decay, self.global_decay
        g_hits, g_seen = self._global_hits, self._global_seen
        drafted_at, accepted_at = self.position_drafted, self.position_accepted
        per_request = self._per_request
        for request_id, drafted, accepted in steps:
            counts = per_request.get(request_id)
            if counts is None:
                counts = per_request[request_id] = ([0.0] * k_max, [0.0] * k_max)
            hits, seen = counts
            for j in range(min(accepted + 1, drafted, k_max)):
                hit = j < accepted
                hits[j] = hits[j] * d + hit
                seen[j] = seen[j] * d + 1.0
                g_hits[j] = g_hits[j] * gd + hit
                g_seen[j] = g_seen[j] * gd + 1.0
                drafted_at[j] += 1
                accepted_at[j] += hit
            updated[request_id] = self.steps
            cache[request_id] = (None, prior, until)  # computed when read (`_fill`)
        self._version += 1

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)
        self._updated.pop(request_id, None)
        self._cache.pop(request_id, None)

    def expected_tokens(self, request_id: str, k: int) -> float:
        """Expected committed tokens of a verify step with k drafts (accepted + bonus)."""
        return self.cumulative(request_id)[min(k, self.k_max)]

    def position_rates(self) -> list[float]:
        """Observed acceptance rate per draft position (for metrics)."""
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]
