"""Per-request draft trimming for verify steps that are not padded (no CUDA graphs): every
verified draft then costs its share of the target's time."""

from __future__ import annotations

from specserve.speculative.cost_model import StepCostModel


def trim_drafts(
    cost: StepCostModel,
    cums: list[list[float]],
    caps: list[int],
    k: int,
    extra_tokens: int,
    context: int = 0,
) -> tuple[list[int], float, float]:
    """Unpadded verify steps at K = k: drop the drafts of lowest expected gain while that
    raises the step's expected goodput (each dropped draft saves its target time). `cums`:
    each request's expected tokens by draft length; `caps`: its most useful drafts;
    `context`: the requests' tokens (the step's periods include their attention). Returns
    (draft lengths, expected tokens, ms)."""
    draft_lens = [min(k, c) for c in caps]
    tokens = sum(c[kr] for c, kr in zip(cums, draft_lens))
    ms = cost.step_ms(draft_lens, extra_tokens, context)
    if not k:
        return draft_lens, tokens, ms
    drops = sorted(
        (c[j + 1] - c[j], -j, r)
        for r, (c, kr) in enumerate(zip(cums, draft_lens))
        for j in range(kr)
    )
    target, period = cost.target, cost.period_ms(len(draft_lens), k, extra_tokens, context)
    full = len(draft_lens) * (k + 1) + extra_tokens
    capped = len(draft_lens) * k - sum(draft_lens)  # drafts short of k already (max_useful_drafts)
    left = tokens
    best, best_count = tokens / ms, 0
    for count, (gain, _, _) in enumerate(drops, 1):
        left -= gain
        step_ms = period - (target(full) - target(full - capped - count))
        if step_ms > 0 and left / step_ms > best:
            best, best_count = left / step_ms, count
    if not best_count:
        return draft_lens, tokens, ms
    trimmed = list(draft_lens)
    for _, neg_j, r in drops[:best_count]:
        trimmed[r] = min(trimmed[r], -neg_j)
    trimmed_tokens = sum(c[kr] for c, kr in zip(cums, trimmed))
    trimmed_ms = cost.step_ms(trimmed, extra_tokens, context)
    if trimmed_tokens / trimmed_ms < tokens / ms:  # its K changed, and the table says no
        return draft_lens, tokens, ms
    return trimmed, trimmed_tokens, trimmed_ms
