"""The overlap loop's wait check as it was before the scheduler counted the running
requests (engine/overlap_wait.py): every row scanned. The oracle of tests/engine's
test_running_counts.py and test_context_count.py."""

from __future__ import annotations


def scanned_wait_reason(prev, batch, max_model_len: int = 1 << 62) -> str | None:
    """The reason the check gives for `batch` after `prev`, scanning every row (no drafting
    rows); `max_model_len`: the context limit (default: out of reach)."""
    if not prev.speculative:
        return None
    moved = {id(s.request): s.drafted for s in prev.step_input.sampled}
    if all(
        s.request.committed_len + moved.get(id(s.request), 0) + s.draft_len <= max_model_len
        for s in batch
    ):
        return None
    return "context_limit"


def scanned_sampling_reason(prev, batch) -> str | None:
    """Why `batch` reads prev's tokens before it samples, scanning every row."""
    if any(s.request.penalized for s in batch):
        return "penalties"
    if any(s.request.constrained and s.decoding for s in batch):
        return "grammar"
    if prev.speculative and any(
        s.request.params.min_tokens > s.request.num_generated for s in batch
    ):
        return "min_tokens"
    return None
