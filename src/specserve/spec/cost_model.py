"""Step cost model: target forward time by tokens in the step, drafter step time by batch;
measured at start-up on the actual hardware and refined online from observed steps."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable


class CurveModel:
    """A monotone piecewise-linear curve of milliseconds over a size, with per-point online
    correction factors (exponentially weighted observed/predicted ratios)."""

    def __init__(self, points: dict[int, float], weight: float = 0.1):
        if not points:
            raise ValueError("a cost curve needs at least one measured point")
        self.sizes = sorted(points)
        self.base_ms = [points[s] for s in self.sizes]
        self.scale = [1.0] * len(self.sizes)
        self.weight = weight

    def _ms(self, i: int) -> float:
        return self.base_ms[i] * self.scale[i]

    def __call__(self, size: float) -> float:
        if size <= 0:
            return 0.0
        i = bisect.bisect_left(self.sizes, size)
        if i == 0:
            return self._ms(0)
        if i == len(self.sizes):
            # Extrapolate linearly from the last two points (compute-bound region).
            if len(self.sizes) == 1:
                return self._ms(0) * size / self.sizes[0]
            s0, s1 = self.sizes[-2], self.sizes[-1]
            slope = (self._ms(-1) - self._ms(-2)) / (s1 - s0)
            return self._ms(-1) + slope * (size - s1)
        s0, s1 = self.sizes[i - 1], self.sizes[i]
        f = (size - s0) / (s1 - s0)
        return self._ms(i - 1) * (1 - f) + self._ms(i) * f

    def observe(self, size: float, observed_ms: float) -> None:
        """Move the nearest measured point's correction toward observed/predicted."""
        predicted = self(size)
        if predicted <= 0 or observed_ms <= 0:
            return
        i = min(range(len(self.sizes)), key=lambda j: abs(self.sizes[j] - size))
        ratio = min(max(observed_ms / predicted, 0.25), 4.0)
        self.scale[i] *= (1 - self.weight) + self.weight * ratio


class StepCostModel:
    """Predicts a step's time from its shape: target(tokens) + sum over draft steps of
    drafter(batch of requests still drafting)."""

    def __init__(self, target: CurveModel, drafter: CurveModel | None):
        self.target = target
        self.drafter = drafter

    def step_ms(self, num_tokens: int, draft_lens: list[int]) -> float:
        ms = self.target(num_tokens)
        if self.drafter is not None and draft_lens:
            for j in range(max(draft_lens)):
                ms += self.drafter(sum(1 for k in draft_lens if k > j))
        return ms


def measure_curve(
    run: Callable[[int], None], sizes: list[int], repeats: int = 2, budget_s: float = 4.0
) -> CurveModel:
    """Time `run(size)` (which must synchronize) for sizes in ascending order; keep the
    fastest run of each (the least disturbed by other work on the machine; online
    refinement corrects the rest). Sizes left once `budget_s` is spent are extrapolated
    from the last two points, so start-up stays short on slow machines."""
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
