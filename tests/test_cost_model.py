"""The step cost model's online estimates: steady periods robust to outliers yet following
lasting changes, and the one-off cost of switching K by bucket and direction."""

from __future__ import annotations

import random

from specserve.spec.cost_model import CurveModel, StepCostModel

TARGET = CurveModel({1: 0.45, 64: 0.5, 256: 0.7})
DRAFTER = CurveModel({1: 0.09, 64: 0.1})


def _model() -> StepCostModel:
    return StepCostModel(TARGET, DRAFTER, padded=True)


def _settle(cost: StepCostModel, n: int, k: int, ms: float, steps: int = 60, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(steps):
        cost.observe(n, k, ms * rng.uniform(0.9, 1.1))


def test_one_slow_step_moves_an_established_estimate_little():
    cost = _model()
    _settle(cost, 1, 0, 1.1)
    before = cost.period_ms(1, 0)
    assert abs(before / 1.1 - 1) < 0.05
    cost.observe(1, 0, 20 * 1.1)  # a collection pause
    assert cost.period_ms(1, 0) < 1.08 * before


def test_a_lasting_change_is_followed():
    cost = _model()
    _settle(cost, 1, 3, 2.0)
    _settle(cost, 1, 3, 3.0, steps=25, seed=1)  # e.g. another process now shares the host
    assert abs(cost.period_ms(1, 3) / 3.0 - 1) < 0.1


def test_first_observation_replaces_the_seed():
    cost = _model()
    assert cost.period_ms(8, 0) == TARGET(8)  # the seed: the target's forward alone
    cost.observe(8, 0, 1.2)
    assert abs(cost.period_ms(8, 0) - 1.2) < 1e-9
    assert cost.observations(8, 0) == 1


def test_a_probe_far_from_a_stale_estimate_counts_as_new():
    """A K probed after a long pause whose period moved a lot: the cell moves a long way,
    is flagged (the policy measures it again soon) and its next observations weigh more."""
    cost = _model()
    _settle(cost, 64, 2, 8.0, steps=20)
    _settle(cost, 64, 0, 2.0, steps=40)  # the policy used K=0 meanwhile
    cost.observe(64, 2, 3.0)
    assert cost.surprised(64, 2) and cost.observations(64, 2) == 1
    assert cost.period_ms(64, 2) < 0.65 * 8.0  # half way (in log) at once
    cost.observe(64, 2, 3.0)
    assert not cost.surprised(64, 2) and cost.period_ms(64, 2) < 4.0


def test_switch_costs_by_bucket_and_direction():
    cost = _model()
    cost.observe(1, 0, 1.0)
    cost.observe(1, 3, 2.0)
    # unmeasured: half a plain step to or from plain decoding, nothing between two K > 0
    assert cost.switch_costs(1) == {"up": 0.5, "down": 0.5, "lateral": 0.0}
    for _ in range(30):
        cost.observe_switch(1, 0, 3, 2.0 + 3.0, 2.0)  # a catch-up: 3 ms on top of a K=3 step
        cost.observe_switch(1, 3, 0, 1.0 + 0.4, 1.0)
        cost.observe_switch(1, 3, 2, 1.7, 1.7)
    sw = cost.switch_costs(1)
    assert abs(sw["up"] - 3.0) < 0.1 and abs(sw["down"] - 0.4) < 0.05 and sw["lateral"] < 0.05
    assert cost.switch_ms(1, 0, 2) == sw["up"] and cost.switch_ms(1, 2, 2) == 0.0
    assert cost.switch_costs(2) == sw  # the nearest measured bucket's
    cost.observe_switch(1, 0, 3, 2.0 + 30.0, 2.0)  # one pathological switch
    assert cost.switch_ms(1, 0, 3) < 4.5
