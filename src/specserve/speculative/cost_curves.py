"""Start-up cost curves: milliseconds of the target's forward by tokens and of a drafter pass
by batch, measured once on this machine (the seeds of the step cost model); and the
device's memory bandwidth, which prices the KV reads of decode attention."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch


class CurveModel:
    """A monotone piecewise-linear curve of milliseconds over a size (linear extrapolation
    past the last measured point)."""

    def __init__(self, points: dict[int, float]):
        if not points:
            raise ValueError("a cost curve needs at least one measured point")
        self.sizes = sorted(points)
        self.ms = [points[s] for s in self.sizes]
        self._memo: dict[float, float] = {}  # the policy reads a few sizes every step

    def __call__(self, size: float) -> float:
        ms = self._memo.get(size)
        if ms is None:
            ms = self._interpolate(size)
            if len(self._memo) < 4096:
                self._memo[size] = ms
        return ms

    def _interpolate(self, size: float) -> float:
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


def measure_curve(
    run: Callable[[int], None],
    sizes: list[int],
    repeats: int = 2,
    budget_s: float | None = 4.0,
) -> CurveModel:
    """Time `run(size)` (which must synchronize) for sizes in ascending order; keep the
    fastest run of each (the least disturbed by other work on the machine; the online
    table corrects the rest). Sizes left once `budget_s` is spent are extrapolated from the
    last two points, so start-up stays short on slow machines (None: every size)."""
    points: dict[int, float] = {}
    start = time.perf_counter()
    for size in sorted(sizes):
        if budget_s is not None and len(points) >= 2 and time.perf_counter() - start > budget_s:
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


def memory_bandwidth(device: torch.device, nbytes: int = 64 << 20, repeats: int = 10) -> float:
    """The device's memory bandwidth in bytes per ms: the fastest of `repeats` copies of
    `nbytes` (each reads and writes them), after one to warm up; 0 where it cannot be timed
    (not a GPU, or no memory to spare)."""
    if device.type != "cuda":
        return 0.0
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
    except torch.OutOfMemoryError:
        return 0.0
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return 2 * nbytes / best if best > 0 else 0.0
