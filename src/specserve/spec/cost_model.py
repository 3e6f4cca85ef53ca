"""Step cost model: what a whole step of a given shape costs, in wall-clock milliseconds.

Seeds come from start-up measurements (the target's forward by tokens per step, one drafter
pass by batch). They leave out what only real steps show: host work of speculative steps
(proposing, verification, processing), graph padding, drafter passes that run without a
whole-chain graph, and the overlap of host and device work. So the policy's costs are an
online table of whole-step periods keyed by (batch bucket, draft length K): each cell holds
an exponentially weighted ratio of observed period to seed, so the seed's shape within a
bucket is kept and the level is what steps of that shape actually took. The first step at
a new K pays one-off costs (a drafter catch-up, a host wait that overlap would have hidden):
those are their own online table, by bucket and direction of the switch.
"""

from __future__ import annotations

import bisect
import math
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


def _nearest_bucket(cells: dict, bucket: int, tag):
    """The cell keyed (b, tag) whose batch bucket b is nearest to `bucket` (in powers of two;
    the smaller on a tie), or None when no bucket has one."""
    seen = [b for (b, t) in cells if t == tag]
    if not seen:
        return None
    return cells[(min(seen, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b)), tag)]


def batch_bucket(num_requests: int) -> int:
    """Cells of the period table: powers of two (1, 2, 4, ..., 64, 128, ...)."""
    return 1 << max(0, num_requests - 1).bit_length()


class RobustMean:
    """An exponentially weighted mean that cuts outliers: a value further from it than `cut`
    and than SPREAD_Z mean absolute deviations counts as if it were at that distance, so one
    slow step (a collection pause, a page fault) moves it a little, and a lasting change
    (which widens the spread) within a few observations."""

    __slots__ = ("value", "count", "spread", "last", "surprised")
    SPREAD_Z = 2.5
    SPREAD_WEIGHT = 0.15
    SPREAD_CAP = 4.0

    def __init__(self, value: float, spread: float):
        self.value, self.spread = value, spread
        self.count = 0
        self.last = 0  # the owner's observation clock at the last update
        self.surprised = False  # the owner found its last update far off (StepCostModel)

    def update(self, x: float, weight: float, cut: float) -> None:
        dev = x - self.value
        cut = max(cut, self.SPREAD_Z * self.spread)
        self.spread += self.SPREAD_WEIGHT * (min(abs(dev), self.SPREAD_CAP * cut) - self.spread)
        self.value += weight * min(max(dev, -cut), cut)
        self.count += 1


def _direction(k_from: int, k_to: int) -> str:
    return "up" if not k_from else "down" if not k_to else "lateral"


class StepCostModel:
    """Predicted wall-clock ms of a step: `n` decoding requests with draft lengths `ks`
    (K = max(ks) sets the shape), plus `extra_tokens` prefill tokens; and what the first
    step at a new K costs on top (`switch_ms`).

    period(n, K) = seed(n, K) * ratio[bucket(n), K]; seed = target(n (K+1)) + K drafter(n).
    A cell without observations borrows the ratio of the nearest observed bucket with the
    same K, else of the nearest observed K at its bucket, else 1.0. `padded`: verify steps
    pad every request to K drafts (CUDA graphs), so shorter drafts save nothing; otherwise
    each draft not verified saves its share of the target's time. Ratios are robust means
    in log space (outliers cut), switch costs robust means in ms by bucket and direction
    (up: from plain decoding, down: back to it, lateral: between two K > 0).
    """

    WEIGHT = 0.15  # EWMA weight of an observation in a cell observed every step
    STALE_AGE = 16  # observations of other cells after which a cell's estimate is stale
    STALE_WEIGHT = 0.5  # what an observation of a stale cell weighs (probes)
    SURPRISE = 1.25
    CLAMP = 3.0  # the first observation of a cell, or one after a pause, moves its ratio by
    CUT = 0.25  # at most this factor; others by at least exp(CUT) (more if periods vary more)
    SWITCH_WEIGHT = 0.2
    SWITCH_PRIOR = 0.5  # an unmeasured switch to or from plain decoding: half a plain step

    def __init__(self, target: CurveModel, drafter: CurveModel | None, padded: bool = False):
        self.target = target
        self.drafter = drafter
        self.padded = padded
        self._cells: dict[tuple[int, int], RobustMean] = {}  # (bucket, K) -> log ratio
        self._switch: dict[tuple[int, str], RobustMean] = {}  # (bucket, direction) -> ms
        self._measured_ks: set[int] = set()
        self._clock = 0

    def seed_ms(self, n: int, k: int) -> float:
        ms = self.target(n * (k + 1))
        if k and self.drafter is not None:
            ms += k * self.drafter(n)
        return ms

    def ratio(self, bucket: int, k: int) -> float:
        cell = self._cells.get((bucket, k))
        if cell is None:
            cell = _nearest_bucket(self._cells, bucket, k)
            if cell is None:
                # Host overhead missing from the seeds is shared by every K of a batch size.
                here = [kk for (b, kk) in self._cells if b == bucket]
                if not here:
                    return 1.0
                cell = self._cells[(bucket, min(here, key=lambda kk: (abs(kk - k), kk)))]
        return math.exp(cell.value)

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

    def measured_k(self, k: int) -> bool:
        """Whether steps of draft length k have been measured at any batch size."""
        return k in self._measured_ks

    def surprised(self, n: int, k: int) -> bool:
        """Whether the cell's last observation, after a pause, was far from its estimate."""
        cell = self._cells.get((batch_bucket(n), k))
        return cell is not None and cell.surprised

    def observations(self, n: int, k: int) -> int:
        cell = self._cells.get((batch_bucket(n), k))
        return cell.count if cell is not None else 0

    def observe(self, n: int, k: int, period_ms: float) -> None:
        """A steady step (same K as the one before it) of n decoding requests took
        period_ms from the previous step's tokens to its own. The first few observations
        of a cell replace its seed; one after STALE_AGE observations of other cells (a probe
        of a K not in use) weighs STALE_WEIGHT and is not cut, and if it moves the cell by
        more than a factor SURPRISE the cell counts as new again (its next observations
        weigh more, and the policy measures it again soon)."""
        seed = self.seed_ms(n, k)
        if seed <= 0 or period_ms <= 0:
            return
        key = (batch_bucket(n), k)
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = RobustMean(math.log(self.ratio(*key)), self.CUT / 2)
            self._measured_ks.add(k)
        self._clock += 1
        stale = cell.count and self._clock - cell.last > self.STALE_AGE
        if not cell.count:  # the seed may be far off
            weight, cut = 1.0, math.log(self.CLAMP)
        elif stale:
            weight, cut = self.STALE_WEIGHT, math.log(self.CLAMP)
        else:
            weight, cut = max(self.WEIGHT, 1.0 / (cell.count + 1)), self.CUT
        before = cell.value
        cell.update(math.log(period_ms / seed), weight, cut)
        moved = abs(cell.value - before)
        cell.surprised = bool(stale) and moved > math.log(self.SURPRISE)
        if cell.surprised:
            cell.count, cell.spread = 1, max(cell.spread, moved)
        cell.last = self._clock

    def snapshot(self) -> dict:
        """The online tables as plain data (diagnostics): "bucket:K" -> (ratio of period to
        seed, observations) and "bucket:direction" -> (switch cost in ms, observations)."""
        return {"ratio": _fmt(self._cells, lambda c: math.exp(c.value)),
                "switch_ms": _fmt(self._switch, lambda c: c.value)}  # fmt: skip

    def switch_ms(self, n: int, k_from: int, k_to: int) -> float:
        """What the first step at K=k_to after one at k_from costs beyond a steady step."""
        if k_from == k_to:
            return 0.0
        return self.switch_costs(n)[_direction(k_from, k_to)]

    def switch_costs(self, n: int, plain_ms: float | None = None) -> dict[str, float]:
        """switch_ms by direction ("up", "down", "lateral") at batch size n. A bucket without
        measurements borrows the nearest measured bucket's; unmeasured anywhere: switching
        to or from plain decoding costs SWITCH_PRIOR of a plain step (`plain_ms` if the
        caller knows it), between K > 0 nothing."""
        bucket = batch_bucket(n)
        out, prior = {"lateral": 0.0}, None
        for direction in ("up", "down", "lateral"):
            cell = self._switch.get((bucket, direction))
            if cell is None:
                cell = _nearest_bucket(self._switch, bucket, direction)
            if cell is not None:
                out[direction] = max(0.0, cell.value)
            elif direction != "lateral":
                if prior is None:
                    prior = self.SWITCH_PRIOR * (plain_ms or self.period_ms(n, 0))
                out[direction] = prior
        return out

    def observe_switch(self, n: int, k_from: int, k_to: int, period_ms: float,
                       steady_ms: float) -> None:  # fmt: skip
        """The first step at a new K (after one at k_from) took period_ms and the next one,
        steady at that K, steady_ms: the difference is what the switch cost (measured in
        pairs, so that an old estimate of the new K's period does not count as one)."""
        if k_from == k_to or period_ms <= 0 or steady_ms <= 0:
            return
        key = (batch_bucket(n), _direction(k_from, k_to))
        cell = self._switch.get(key)
        if cell is None:
            cell = self._switch[key] = RobustMean(period_ms - steady_ms, self.CUT * steady_ms)
            cell.count = 1
            return
        weight = max(self.SWITCH_WEIGHT, 1.0 / (cell.count + 1))
        cell.update(period_ms - steady_ms, weight, self.CUT * steady_ms)


def _fmt(table: dict, value) -> dict:
    return {f"{a}:{b}": (round(value(c), 4), c.count) for (a, b), c in sorted(table.items())}


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
