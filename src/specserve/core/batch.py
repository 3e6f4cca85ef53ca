"""A request's share of one step (what the scheduler hands the runner and the proposer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specserve.core.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step: `num_tokens` committed tokens starting at
    `cached_len`, plus up to `draft_len` speculative tokens that the proposer fills in
    (`drafts`, and `draft_probs` [draft_len, V] when the drafter sampled from a distribution
    for a request without a seed: runtime/verify.py).
    The scheduler sets `draft_len` (the policy's choice, clamped to the budget, the context
    and the pages); `drafted` counts the drafts actually filled in."""

    request: Request
    num_tokens: int
    draft_len: int = 0
    decoding: bool = False  # one committed token to feed (not a prefill chunk)
    drafts: list[int] = field(default_factory=list)
    draft_probs: Any = None
    # Drafts the proposer left on the device instead: (tokens [B, draft_len], this request's row);
    # `drafts` gets their values once the step's tokens reach the host.
    device_drafts: Any = None

    @property
    def drafted(self) -> int:
        """Drafts this request carries into the verify step, whether their values are on the
        host or the device: `draft_len` when they are on the device, else as many as the
        proposer found (an n-gram lookup may find fewer than `draft_len`)."""
        return self.draft_len if self.device_drafts is not None else len(self.drafts)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the request's tokens, so a token is drawn."""
        req = self.request
        return req.cached_len + self.num_tokens == req.committed_len
