"""Acceptance estimates: per-request, per-draft-position, exponentially weighted, with the
global estimate as the prior of new requests."""

from __future__ import annotations


class AcceptanceModel:
    """alpha[j] estimates P(draft j+1 accepted | drafts 1..j accepted).

    The global estimate follows every verify step; a request's own estimate starts from the
    global one and then follows that request, so requests whose drafts are poor stop
    speculating while others go on.
    """

    def __init__(self, k_max: int, prior: float = 0.6, weight: float = 0.2):
        self.k_max = k_max
        self.weight = weight
        self.global_alpha = [prior] * k_max
        self._per_request: dict[str, list[float]] = {}
        self.position_drafted = [0] * k_max
        self.position_accepted = [0] * k_max

    def alpha(self, request_id: str) -> list[float]:
        return self._per_request.get(request_id, self.global_alpha)

    def update(self, request_id: str, drafted: int, accepted: int) -> None:
        """Record a verify step: positions 1..accepted accepted, accepted+1 rejected."""
        own = self._per_request.setdefault(request_id, list(self.global_alpha))
        w = self.weight
        for j in range(min(accepted + 1, drafted, self.k_max)):
            hit = 1.0 if j < accepted else 0.0
            own[j] += w * (hit - own[j])
            self.global_alpha[j] += 0.5 * w * (hit - self.global_alpha[j])
            self.position_drafted[j] += 1
            self.position_accepted[j] += int(hit)

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def expected_tokens(self, request_id: str, k: int) -> float:
        """Expected committed tokens of a verify step with k drafts (accepted + bonus)."""
        total, run = 1.0, 1.0
        for a in self.alpha(request_id)[:k]:
            run *= a
            total += run
        return total

    def position_rates(self) -> list[float]:
        """Observed acceptance rate per draft position (for metrics)."""
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]
