"""Batch buckets: the rows of the step cost model's tables (powers of two), and the nearest
measured row where a bucket has none."""

from __future__ import annotations

import functools


@functools.cache  # read a dozen times per policy decision
def batch_bucket(num_requests: int) -> int:
    """Cells of the period table: powers of two (1, 2, 4, ..., 64, 128, ...)."""
    return 1 << max(0, num_requests - 1).bit_length()


def nearest_bucket(cells: dict, bucket: int, tag):
    """The cell keyed (b, tag) whose batch bucket b is nearest to `bucket` (in powers of two;
    the smaller on a tie), or None when no bucket has one."""
    seen = [b for (b, t) in cells if t == tag]
    if not seen:
        return None
    return cells[(min(seen, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b)), tag)]
