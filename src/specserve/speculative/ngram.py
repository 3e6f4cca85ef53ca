"""Prompt-lookup drafting: continue the latest earlier occurrence of the current suffix."""

from __future__ import annotations

from specserve.core.batch import ScheduledRequest
from specserve.speculative.proposer import Proposer


class NgramProposer(Proposer):
    """Matches the last n tokens (n from max_n down to min_n) against the request's own
    prompt and output, and proposes the tokens that followed the most recent match."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, items: list[ScheduledRequest]) -> None:
        for it in items:
            it.drafts = self.lookup(it.request.all_token_ids, it.draft_len)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # Latest earlier occurrence: scan start positions from right to left.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + k]
                    if follow:
                        return follow
        return []
