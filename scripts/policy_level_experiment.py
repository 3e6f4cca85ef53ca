"""Experiment (not adopted): a shared level of conditions in the goodput policy's cost model,
against the model as it is, in the policy simulator with and without slow stretches
(tests/policy_sim_workload.py `Noise.stretch_*`). Prints the markdown table of
gpu_default_model.md's session-18 section: goodput's realized rate over the best fixed
K's, per regime of tests/test_policy_regimes.py.

The level: one log factor shared by every cost cell. Two steady steps in a row of the K in
use (an established cell, observed without a pause) far from its estimate on the same side
move it by the smaller of their excesses, and every cell learns periods less the level, so
that a stretch slowing every K does not raise the K in use above the others' cells. CPU
only, about a minute:

    PYTHONPATH=src:. python scripts/policy_level_experiment.py --seeds 24
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

from specserve.spec.buckets import batch_bucket
from specserve.spec.cost_model import StepCostModel
from tests.policy_sim import LARGE, MEASURED, SMALL, Noise, Workload, compare
from tests.test_policy_regimes import COSTLY_SWITCHES, MEASURED_LOAD


class LevelCostModel(StepCostModel):
    """StepCostModel with the shared level (the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.level = 0.0
        self.jump: float | None = None

    def period_table(self, n, k_top, extra_tokens=0):
        out, raw, cells = super().period_table(n, k_top, extra_tokens)
        f = math.exp(self.level)
        return [ms * f for ms in out], [ms * f for ms in raw], cells

    def period_ms(self, n, k, extra_tokens=0):
        return super().period_ms(n, k, extra_tokens) * math.exp(self.level)

    def observe(self, n, k, period_ms):
        cell = self._cells.get((batch_bucket(n), k))
        seed = self.seed_ms(n, k)
        if cell is not None and seed > 0 < period_ms:
            stale = cell.count and self._clock + 1 - cell.last > self.STALE_AGE
            if cell.count >= self.YOUNG and not stale:
                x = math.log(period_ms / seed) - self.level
                excess, jump = x - cell.value, self.jump
                if not cell.far(x, self.CUT):
                    self.jump = None
                elif jump is None or (jump > 0) != (excess > 0):
                    self.jump = excess
                else:
                    self.level += jump if abs(jump) < abs(excess) else excess
                    self.jump = None
        super().observe(n, k, period_ms / math.exp(self.level))


def regime_cases():
    load8 = replace(MEASURED_LOAD, batch=8, rounds=3)
    return [("measured (SmolLM2 on the H200), batch 1", MEASURED, MEASURED_LOAD, 0.05),
            ("measured, batch 8", MEASURED, load8, 0.05),
            ("host-bound, batch 1", SMALL, Workload(1, 8), 0.2),
            ("host-bound, batch 8", SMALL, Workload(8, 3), 0.2),
            ("GPU-bound, batch 1", LARGE, Workload(1, 8), 0.2),
            ("GPU-bound, batch 64", LARGE, Workload(64, 2), 0.2),
            ("costly switches, batch 1", COSTLY_SWITCHES, Workload(1, 8), 0.2)]  # fmt: skip


def ratios(regime, wl, sigma: float, seeds: tuple) -> list[float]:
    """goodput / best fixed K without, then with, slow stretches."""
    out = []
    for p in (0.0, 1 / 150):
        noise = Noise(sigma=sigma, stretch_p=p, stretch_len=40, stretch_x=1.75)
        out.append(compare(regime, wl, seeds=seeds, noise=noise)["ratio"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=24)
    args = ap.parse_args()
    seeds = tuple(range(args.seeds))
    print("| regime | current policy | with stretches | shared level | with stretches |")
    print("|---|---|---|---|---|")
    import tests.policy_sim_engines as engines  # Regime.seeds() builds the cost model

    for name, regime, wl, sigma in regime_cases():
        now = ratios(regime, wl, sigma, seeds)
        engines.StepCostModel = LevelCostModel
        try:
            level = ratios(regime, wl, sigma, seeds)
        finally:
            engines.StepCostModel = StepCostModel
        cells = " | ".join(f"{r:.3f}" for r in (*now, *level))
        print(f"| {name} | {cells} |", flush=True)

if __name__ == "__main__":
    main()
