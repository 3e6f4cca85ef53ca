"""Per-request draft trimming for verify steps that are not padded (no CUDA graphs): every
verified draft then costs its share of the target's time."""

from __future__ import annotations

from specserve.speculative.cost_model import StepCostModel


def trim_drafts(
    cost: StepCostModel, cums: list[list[float]], caps: list[int], k: int, extra_tokens: int
) -> tuple[list[int], float, float]:
    """Unpadded verify steps at K = k: drop the drafts of lowest expected gain while that
    raises the step's expected goodput (each dropped draft saves its target time). `cums`:
    each request's expected tokens by draft length; `caps`: its most useful drafts. Returns
    (draft lengths, expected tokens, ms)."""
    ks = [min(k, c) for c in caps]
    tokens = sum(c[kr] for c, kr in zip(cums, ks))
    ms = cost.step_ms(ks, extra_tokens)
    if not k:
        return ks, tokens, ms
    drops = sorted(
        (c[j + 1] - c[j], -j, r) for r, (c, kr) in enumerate(zip(cums, ks)) for j in range(kr)
    )
    target, period = cost.target, cost.period_ms(len(ks), k, extra_tokens)
    full = len(ks) * (k + 1) + extra_tokens
    capped = len(ks) * k - sum(ks)  # drafts short of k already (max_useful_drafts)
    left = tokens
    best, best_count = tokens / ms, 0
    for count, (gain, _, _) in enumerate(drops, 1):
        left -= gain
        step_ms = period - (target(full) - target(full - capped - count))
        if step_ms > 0 and left / step_ms > best:
            best, best_count = left / step_ms, count
    if not best_count:
        return ks, tokens, ms
    trimmed = list(ks)
    for _, neg_j, r in drops[:best_count]:
        trimmed[r] = min(trimmed[r], -neg_j)
    trimmed_tokens = sum(c[kr] for c, kr in zip(cums, trimmed))
    trimmed_ms = cost.step_ms(trimmed, extra_tokens)
    if trimmed_tokens / trimmed_ms < tokens / ms:  # its K changed, and the table says no
        return ks, tokens, ms
    return trimmed, trimmed_tokens, trimmed_ms
