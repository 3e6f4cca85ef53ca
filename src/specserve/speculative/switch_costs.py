"""What a switch of the draft length K costs beyond steady steps: the step cost model's
second online table, by batch bucket and direction (step_periods.py measures its samples
from the steps around each switch), and what a switch there and back costs."""

from __future__ import annotations

import math
from collections.abc import Callable

from specserve.speculative.buckets import batch_bucket, nearest_bucket
from specserve.speculative.robust_mean import RobustMean

DIRECTIONS = ("up", "down", "lateral")


def direction(k_from: int, k_to: int) -> str:
    """up: from plain decoding, down: back to it, lateral: between two K > 0."""
    return "up" if not k_from else "down" if not k_to else "lateral"


class SwitchCosts:
    """Switch costs in ms by (batch bucket, direction), robust means, signed: the steps
    around a switch may take less than steady ones (SmolLM2 on the H200: about -0.9 ms down and
    +4 ms up at batch 1). A bucket without measurements borrows the nearest measured
    bucket's; a direction measured at no bucket costs the owner's prior to or from plain
    decoding, nothing between K > 0. A sample comes from four step periods, so it is noisy:
    a new cell's first `young` samples are averaged (uncut; the first replaces the prior),
    later ones weigh at least WEIGHT and are cut at `cut` steady periods. (Averaged with the
    prior of half a plain step, the way back to drafting on the default model's host-bound
    clock, ~4.3 ms at 8 and 16 requests, read ~3 after two samples: probes of plain decoding
    and switches priced at two thirds of what they cost; in the serving simulator there
    0.972 and 0.954 of fixed K=3, 0.975 and 0.963 averaging the samples alone.)"""

    WEIGHT = 0.2

    def __init__(self, cut: float, young: int):
        self.cut, self.young = cut, young
        self.cells: dict[tuple[int, str], RobustMean] = {}  # (bucket, direction) -> ms
        self._plans: dict[int, tuple] = {}  # n -> the cells read, until a cell is added
        self._reads: dict[int, dict[str, float]] = {}  # n -> costs, until one is observed

    def costs(self, n: int, prior: Callable[[], float], memoize: bool) -> dict[str, float]:
        """Costs by direction at batch size n (read only: it may be cached). `prior()`: a
        switch to or from plain decoding where none was measured; `memoize`: keep what was
        read (not when a prior was) until the table changes."""
        out = self._reads.get(n)
        if out is not None:
            return out
        out, prior_ms = {"lateral": 0.0}, None
        for d, cell in self._plan(n, memoize):
            if cell is not None:
                out[d] = cell.value
            elif d != "lateral":
                if prior_ms is None:
                    prior_ms = prior()
                out[d] = prior_ms
        if prior_ms is None and memoize:
            self._reads[n] = out
        return out

    def _plan(self, n: int, memoize: bool) -> tuple:
        """(direction, the cell it reads or None) for each direction at n's bucket."""
        plan = self._plans.get(n) if memoize else None
        if plan is None:
            bucket = batch_bucket(n)
            plan = tuple(
                (d, self.cells.get((bucket, d)) or nearest_bucket(self.cells, bucket, d))
                for d in DIRECTIONS
            )
            if memoize:
                self._plans[n] = plan
        return plan

    def observe(
        self,
        n: int,
        k_from: int,
        k_to: int,
        excess_ms: float,
        steady_ms: float,
        prior: Callable[[], float],
    ) -> None:
        """A switch from K=k_from to k_to cost excess_ms beyond steady steps; steady_ms, the
        new K's steady period, scales the outlier cut; `prior()` as in `costs`."""
        if k_from == k_to or steady_ms <= 0:
            return
        self._reads.clear()
        d = direction(k_from, k_to)
        key = (batch_bucket(n), d)
        cell = self.cells.get(key)
        if cell is None:
            start = 0.0 if d == "lateral" else prior()
            cell = self.cells[key] = RobustMean(start, self.cut * steady_ms)
            self._plans.clear()
        if cell.count < self.young:
            cell.update(excess_ms, 1.0 / (cell.count + 1), math.inf)  # (a plain mean)
            return
        weight = max(self.WEIGHT, 1.0 / (cell.count + 2))
        cell.update(excess_ms, weight, self.cut * steady_ms)


def there_and_back(sw: dict[str, float], a: int | None, b: int) -> float:
    """What switching from K=a to K=b and back costs (`sw`: SwitchCosts.costs), never less
    than nothing."""
    if a is None or a == b:
        return 0.0
    if a and b:
        return max(0.0, 2 * sw["lateral"])
    return max(0.0, sw["up"] + sw["down"])


def there_and_back_row(sw: dict[str, float], a: int | None, max_draft_len: int) -> list[float]:
    """[there_and_back(sw, a, b) for b = 0..max_draft_len] (the policy's row of every step)."""
    if a is None:
        return [0.0] * (max_draft_len + 1)
    plain = max(0.0, sw["up"] + sw["down"])  # to or from K=0 (b or a is 0)
    row = (
        [plain] + [max(0.0, 2 * sw["lateral"])] * max_draft_len
        if a
        else [plain] * (max_draft_len + 1)
    )
    if a <= max_draft_len:
        row[a] = 0.0
    return row
