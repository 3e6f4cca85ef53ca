"""An online mean that one outlier barely moves and a lasting change moves within a few
observations (the step cost model's cells)."""

from __future__ import annotations


class RobustMean:
    """An exponentially weighted mean that cuts outliers: a value further from it than `cut`
    and than SPREAD_Z mean absolute deviations counts as if it were at that distance, so one
    slow step (a collection pause, a page fault) moves it a little, and a lasting change
    (which widens the spread) within a few observations."""

    __slots__ = ("value", "count", "spread", "last", "surprised", "doubt")
    SPREAD_Z = 2.5
    SPREAD_WEIGHT = 0.15
    SPREAD_CAP = 4.0

    def __init__(self, value: float, spread: float):
        self.value, self.spread = value, spread
        self.count = 0
        self.last = 0  # the owner's observation clock at the last update
        self.surprised = False  # the owner moved it to a new level lately (StepCostModel)
        self.doubt: float | None = None  # the last observation, when it was far off

    def far(self, x: float, cut: float) -> bool:
        """Whether x lies further from the mean than cut and SPREAD_Z spreads."""
        return abs(x - self.value) > max(cut, self.SPREAD_Z * self.spread)

    def update(self, x: float, weight: float, cut: float) -> None:
        dev = x - self.value
        cut = max(cut, self.SPREAD_Z * self.spread)
        self.spread += self.SPREAD_WEIGHT * (min(abs(dev), self.SPREAD_CAP * cut) - self.spread)
        self.value += weight * min(max(dev, -cut), cut)
        self.count += 1
