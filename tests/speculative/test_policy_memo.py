"""The goodput policy decides the same with the cost model's memoized read plans as with
direct reads: closed-loop simulations and a recorded sequence of steps with prefill sharing
them, batches changing size, unpadded steps, and cells and switch costs appearing."""

from __future__ import annotations

import pytest

from specserve.speculative.cost_model import CurveModel, StepCostModel
from tests.support.policy_replay import replay
from tests.support.policy_sim import LARGE, MEASURED, SMALL, Noise, Workload, simulate

CASES = {
    "measured batch 8": (MEASURED, Workload(8, 2, hard_start=16), Noise(sigma=0.05)),
    "host-bound batch 1": (SMALL, Workload(1, 3), Noise()),
    "GPU-bound batch 64": (LARGE, Workload(64, 1, min_tokens=32, max_tokens=96), Noise()),
}


def _decisions(policy) -> list[tuple]:
    return [
        (d["k"], d["probe"], d["tokens"], d["period_ms"], d["switch_ms"])
        for d in policy.trace.dump()
    ]


@pytest.mark.parametrize("case", CASES)
def test_closed_loop_decisions_do_not_depend_on_memoized_reads(case, monkeypatch):
    regime, workload, noise = CASES[case]
    runs = []
    for memoize in (True, False):
        monkeypatch.setattr(StepCostModel, "memoize", memoize)
        result, policy = simulate("goodput", regime, workload, 3, noise)
        runs.append((result.step_ks, _decisions(policy), policy.predicted_ms))
    assert runs[0] == runs[1]
    assert len(set(runs[0][0])) > 1  # the run changed K: probes, switches


@pytest.mark.parametrize("padded", (True, False))
def test_recorded_steps_decide_the_same_with_memoized_reads(padded, monkeypatch):
    runs = []
    for memoize in (True, False):
        monkeypatch.setattr(StepCostModel, "memoize", memoize)
        runs.append(replay(padded, seed=11)[0])
    assert runs[0] == runs[1]
    assert len({max(draft_lens, default=0) for draft_lens, _, _ in runs[0]}) > 1


def test_a_new_cell_changes_what_periods_read():
    """A plan memoized before a cell existed is not read after it appears."""
    cost = StepCostModel(CurveModel({1: 1.0, 64: 2.0}), CurveModel({1: 0.2}), padded=True)
    before = cost.periods_ms(8, 3)
    for _ in range(3):
        cost.observe(8, 3, 2 * cost.seed_ms(8, 3))
    after = cost.periods_ms(8, 3)
    assert after[3] == pytest.approx(2 * before[3])
