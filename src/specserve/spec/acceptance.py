"""Acceptance estimates: per-request, per-draft-position, exponentially weighted, with the
global estimate as the prior of new requests."""

from __future__ import annotations


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
    request), and PRIOR_WEIGHT pseudo-observations at the global rate are added, so a new
    request starts from the global estimate and two unlucky rejections do not switch
    speculation off (an EWMA of single outcomes flips on them). The global estimate follows
    every verify step over a longer window.
    """

    PRIOR_WEIGHT = 2.0

    def __init__(self, k_max: int, prior: float = 0.6, decay: float = 0.95,
                 global_decay: float = 0.98):  # fmt: skip
        self.k_max = k_max
        self.prior = prior
        self.decay = decay
        self.global_decay = global_decay
        self._global_hits = [0.0] * k_max
        self._global_seen = [0.0] * k_max
        self._global_alpha: list[float] | None = None
        self._global_cumulative: list[float] | None = None
        self._counts: dict[str, tuple[list[float], list[float]]] = {}
        self._per_request: dict[str, list[float]] = {}
        self._cumulative: dict[str, list[float]] = {}  # cache of cumulative_tokens(own)
        self.position_drafted = [0] * k_max
        self.position_accepted = [0] * k_max

    @property
    def global_alpha(self) -> list[float]:
        if self._global_alpha is None:
            m = self.PRIOR_WEIGHT
            self._global_alpha = [
                (h + m * self.prior) / (n + m)
                for h, n in zip(self._global_hits, self._global_seen)
            ]  # fmt: skip
        return self._global_alpha

    def has_observations(self, request_id: str) -> bool:
        """Whether the request has verified drafts (else its estimate is the global one)."""
        return request_id in self._per_request

    def alpha(self, request_id: str) -> list[float]:
        return self._per_request.get(request_id, self.global_alpha)

    def cumulative(self, request_id: str) -> list[float]:
        """`cumulative_tokens(alpha(request_id))`, cached between updates (the policy reads
        it for every request every step)."""
        own = self._cumulative.get(request_id)
        if own is not None:
            return own
        if request_id in self._per_request:
            own = self._cumulative[request_id] = cumulative_tokens(self._per_request[request_id])
            return own
        if self._global_cumulative is None:
            self._global_cumulative = cumulative_tokens(self.global_alpha)
        return self._global_cumulative

    def update(self, request_id: str, drafted: int, accepted: int) -> None:
        """Record a verify step: positions 1..accepted accepted, accepted+1 rejected."""
        self.update_many([(request_id, drafted, accepted)])

    def update_many(self, steps: list[tuple[str, int, int]]) -> None:
        """Record one engine step's verify results, (request_id, drafted, accepted) each;
        every request's prior is the global estimate before the step."""
        if not steps:
            return
        prior, k_max, m = self.global_alpha, self.k_max, self.PRIOR_WEIGHT
        d, gd = self.decay, self.global_decay
        g_hits, g_seen = self._global_hits, self._global_seen
        drafted_at, accepted_at = self.position_drafted, self.position_accepted
        for request_id, drafted, accepted in steps:
            counts = self._counts.get(request_id)
            if counts is None:
                counts = self._counts[request_id] = ([0.0] * k_max, [0.0] * k_max)
            hits, seen = counts
            for j in range(min(accepted + 1, drafted, k_max)):
                hit = j < accepted
                hits[j] = hits[j] * d + hit
                seen[j] = seen[j] * d + 1.0
                g_hits[j] = g_hits[j] * gd + hit
                g_seen[j] = g_seen[j] * gd + 1.0
                drafted_at[j] += 1
                accepted_at[j] += hit
            self._per_request[request_id] = [
                (h + m * g) / (n + m) for h, n, g in zip(hits, seen, prior)
            ]  # fmt: skip
            self._cumulative.pop(request_id, None)
        self._global_alpha = self._global_cumulative = None

    def forget(self, request_id: str) -> None:
        self._counts.pop(request_id, None)
        self._per_request.pop(request_id, None)
        self._cumulative.pop(request_id, None)

    def expected_tokens(self, request_id: str, k: int) -> float:
        """Expected committed tokens of a verify step with k drafts (accepted + bonus)."""
        return self.cumulative(request_id)[min(k, self.k_max)]

    def position_rates(self) -> list[float]:
        """Observed acceptance rate per draft position (for metrics)."""
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]
