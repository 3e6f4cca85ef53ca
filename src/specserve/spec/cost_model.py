"""Step cost model: what a whole step of a given shape costs, in wall-clock milliseconds.

Seeds come from start-up measurements (the target's forward by tokens per step, one drafter
pass by batch). They leave out what only real steps show: host work of speculative steps
(proposing, verification, processing), graph padding, drafter passes that run without a
whole-chain graph, and the overlap of host and device work. So the policy's costs are an
online table of whole-step periods keyed by (batch bucket, draft length K): each cell holds
an exponentially weighted ratio of observed period to seed, so the seed's shape within a
bucket is kept and the level is what steps of that shape actually took.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable


class CurveModel:
    """A monotone piecewise-linear curve of milliseconds over a size (linear extrapolation
    past the last measured point)."""

    def __init__(self, points: dict[int, float]):
        if not points:
            raise ValueError("a cost curve needs at least one measured point")
        self.sizes = sorted(points)
        self.ms = [points[s] for s in self.sizes]

    def __call__(self, size: float) -> float:
        if size <= 0:
            return 0.0
        i = bisect.bisect_left(self.sizes, size)
        if i == 0:
            return self.ms[0]
        if i == len(self.sizes):
            if len(self.sizes) == 1:
                return self.ms[0] * size / self.sizes[0]
            s0, s1 = self.sizes[-2], self.sizes[-1]
            return self.ms[-1] + (self.ms[-1] - self.ms[-2]) / (s1 - s0) * (size - s1)
        s0, s1 = self.sizes[i - 1], self.sizes[i]
        f = (size - s0) / (s1 - s0)
        return self.ms[i - 1] * (1 - f) + self.ms[i] * f


def batch_bucket(num_requests: int) -> int:
    """Cells of the period table: powers of two (1, 2, 4, ..., 64, 128, ...)."""
    return 1 << max(0, num_requests - 1).bit_length()


class StepCostModel:
    """Predicted wall-clock ms of a step: `n` decoding requests with draft lengths `ks`
    (K = max(ks) sets the shape), plus `extra_tokens` prefill tokens.

    period(n, K) = seed(n, K) * ratio[bucket(n), K]; seed = target(n (K+1)) + K drafter(n).
    A cell without observations borrows the ratio of the nearest observed bucket with the
    same K, else of the nearest observed K at its bucket, else 1.0. `padded`: verify steps
    pad every request to K drafts (CUDA graphs), so shorter drafts save nothing; otherwise
    each draft not verified saves its share of the target's time.
    """

    WEIGHT = 0.15  # EWMA weight of an observation in a cell observed every step
    STALE_WEIGHT = 0.5  # the most an observation after a long pause weighs (probes)
    CLAMP = 3.0  # an observation moves a cell's ratio by at most this factor

    def __init__(self, target: CurveModel, drafter: CurveModel | None, padded: bool = False):
        self.target = target
        self.drafter = drafter
        self.padded = padded
        self._ratio: dict[tuple[int, int], float] = {}
        self._count: dict[tuple[int, int], int] = {}
        self._last: dict[tuple[int, int], int] = {}  # observation clock of each cell's last
        self._clock = 0

    def seed_ms(self, n: int, k: int) -> float:
        ms = self.target(n * (k + 1))
        if k and self.drafter is not None:
            ms += k * self.drafter(n)
        return ms

    def ratio(self, bucket: int, k: int) -> float:
        r = self._ratio.get((bucket, k))
        if r is not None:
            return r
        seen = [b for (b, kk) in self._ratio if kk == k]
        if seen:
            nearest = min(seen, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
            return self._ratio[(nearest, k)]
        # Host overhead missing from the seeds is shared by every K of a batch size.
        here = [kk for (b, kk) in self._ratio if b == bucket]
        if here:
            return self._ratio[(bucket, min(here, key=lambda kk: (abs(kk - k), kk)))]
        return 1.0

    def period_ms(self, n: int, k: int, extra_tokens: int = 0) -> float:
        """A step of n requests all drafting k, plus prefill tokens."""
        ms = self.seed_ms(n, k) * self.ratio(batch_bucket(n), k)
        if extra_tokens:
            verify = n * (k + 1)
            ms += self.target(verify + extra_tokens) - self.target(verify)
        return ms

    def step_ms(self, ks: list[int], extra_tokens: int = 0) -> float:
        """A step with these per-request draft lengths (nonempty)."""
        n, k = len(ks), max(ks)
        ms = self.period_ms(n, k, extra_tokens)
        if not self.padded or extra_tokens:
            full = n * (k + 1) + extra_tokens
            ms -= self.target(full) - self.target(full - (n * k - sum(ks)))
        return ms

    def observations(self, n: int, k: int) -> int:
        return self._count.get((batch_bucket(n), k), 0)

    def observe(self, n: int, k: int, period_ms: float) -> None:
        """A steady step (same K as the one before it) of n decoding requests took
        period_ms from the previous step's tokens to its own. The weight grows with the
        observations (of any cell) since the cell's last one, so a rare probe of a K not in
        use moves its stale estimate a long way, and the first few replace the seed."""
        seed = self.seed_ms(n, k)
        if seed <= 0 or period_ms <= 0:
            return
        key = (batch_bucket(n), k)
        count = self._count.get(key, 0)
        old = self.ratio(key[0], k)
        new = min(max(period_ms / seed, old / self.CLAMP), old * self.CLAMP)
        self._clock += 1
        age = self._clock - self._last.get(key, self._clock - 1)
        stale = min(self.STALE_WEIGHT, 1.0 - (1.0 - self.WEIGHT) ** age)
        w = max(stale, 1.0 / (count + 1))
        self._ratio[key] = old + w * (new - old)
        self._count[key] = count + 1
        self._last[key] = self._clock


def measure_curve(
    run: Callable[[int], None], sizes: list[int], repeats: int = 2, budget_s: float = 4.0
) -> CurveModel:
    """Time `run(size)` (which must synchronize) for sizes in ascending order; keep the
    fastest run of each (the least disturbed by other work on the machine; the online
    table corrects the rest). Sizes left once `budget_s` is spent are extrapolated from the
    last two points, so start-up stays short on slow machines."""
    points: dict[int, float] = {}
    start = time.perf_counter()
    for size in sorted(sizes):
        if len(points) >= 2 and time.perf_counter() - start > budget_s:
            break
        run(size)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(size)
            times.append((time.perf_counter() - t0) * 1e3)
        points[size] = min(times)
    # Enforce monotonicity: a bigger step never costs less (noise otherwise misleads).
    running = 0.0
    for size in sorted(points):
        running = max(running, points[size])
        points[size] = running
    return CurveModel(points)


def powers_of_two(limit: int) -> list[int]:
    sizes, s = [], 1
    while s < limit:
        sizes.append(s)
        s *= 2
    return sizes + [limit]
