"""The step cost model's online estimates: steady periods robust to outliers yet following
lasting changes, and the one-off cost of switching K by bucket and direction."""

from __future__ import annotations

import random

import pytest

from specserve.speculative.cost_model import CurveModel, StepCostModel, there_and_back

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


def test_a_probe_far_from_a_stale_estimate_moves_once_confirmed():
    """A K probed after a long pause: one far observation (maybe an outlier) moves the cell
    little and flags it doubtful (the policy measures it again soon); a second far one on
    the same side confirms a lasting change: the cell moves there at once, counts as new and
    is flagged as surprised; its next observations weigh more."""
    cost = _model()
    _settle(cost, 64, 2, 8.0, steps=20)
    _settle(cost, 64, 0, 2.0, steps=40)  # the policy used K=0 meanwhile
    cost.observe(64, 2, 3.0)
    assert cost.doubtful(64, 2) and cost.period_ms(64, 2) > 0.85 * 8.0
    cost.observe(64, 2, 3.0)
    assert not cost.doubtful(64, 2) and cost.surprised(64, 2)
    assert cost.observations(64, 2) == 1 and abs(cost.period_ms(64, 2) / 3.0 - 1) < 0.01
    cost.observe(64, 2, 3.3)
    assert not cost.surprised(64, 2) and cost.period_ms(64, 2) > 3.1


def test_a_far_observation_not_confirmed_is_dismissed():
    cost = _model()
    _settle(cost, 1, 3, 1.8, steps=300)
    _settle(cost, 1, 0, 1.0, steps=40)
    cost.observe(1, 3, 1.1)  # e.g. the last step before the engine idled
    cost.observe(1, 3, 1.8)
    assert not cost.doubtful(1, 3) and abs(cost.period_ms(1, 3) / 1.8 - 1) < 0.06
    assert cost.observations(1, 3) > 300


def test_periods_never_rise_with_fewer_drafts():
    cost = _model()
    for k, ms in enumerate((1.0, 2.6, 2.1, 1.9)):  # K=1, 2 measured high a few times
        cost.observe(1, k, ms)
    assert [round(ms, 6) for ms in cost.periods_ms(1, 3)] == [1.0, 1.9, 1.9, 1.9]


def test_switch_costs_by_bucket_and_direction():
    cost = _model()
    cost.observe(1, 0, 1.0)
    cost.observe(1, 3, 2.0)
    # unmeasured: half a plain step to or from plain decoding, nothing between two K > 0
    assert cost.switch_costs(1) == {"up": 0.5, "down": 0.5, "lateral": 0.0}
    for _ in range(30):
        cost.observe_switch(1, 0, 3, 3.0, 2.0)  # a catch-up: 3 ms on top of steady steps
        cost.observe_switch(1, 3, 0, -0.4, 1.0)  # the steps around it were shorter
        cost.observe_switch(1, 3, 2, 0.0, 1.7)
    sw = cost.switch_costs(1)
    assert abs(sw["up"] - 3.0) < 0.1 and abs(sw["down"] + 0.4) < 0.05 and abs(sw["lateral"]) < 0.05
    assert cost.switch_ms(1, 0, 2) == sw["up"] and cost.switch_ms(1, 2, 2) == 0.0
    assert cost.switch_costs(2) == sw  # the nearest measured bucket's
    assert abs(there_and_back(sw, 0, 3) - 2.6) < 0.1 and there_and_back(sw, 3, 3) == 0.0
    assert there_and_back({"up": -1.0, "down": 0.5, "lateral": -0.2}, 2, 3) == 0.0
    cost.observe_switch(1, 0, 3, 30.0, 2.0)  # one pathological switch
    assert cost.switch_ms(1, 0, 3) < 4.5


def test_cells_measured_at_other_contexts_compare_at_the_step_context():
    """Decode attention reads every context token's KV once a step, whatever K: the cells
    learn periods without it and predictions add it at the step's own context. Plain
    decoding measured late (long contexts) and K=1 early (short ones) would otherwise read
    15 ms against 7 and make K=1 look the cheaper per token; at one context they read
    their true difference."""
    cost = StepCostModel(CurveModel({1: 4.0, 64: 5.0, 128: 6.0}), CurveModel({64: 1.0}), True)
    cost.context_ms_per_token = 0.01
    for _ in range(60):
        cost.observe(64, 0, 5.0 + 10.0, context=1000)
        cost.observe(64, 1, 6.0 + 1.0, context=100)  # K=1 at 100
    out, raw, _ = cost.period_table(64, 1, context=500)
    assert out == pytest.approx([10.0, 11.0], rel=0.01) and raw == out
    assert cost.period_ms(64, 1, context=500) == pytest.approx(11.0, rel=0.01)
    assert cost.step_ms([1] * 64, context=0) == pytest.approx(6.0, rel=0.01)


def test_memory_bandwidth_needs_a_gpu():
    import torch

    from specserve.speculative.cost_curves import memory_bandwidth

    assert memory_bandwidth(torch.device("cpu")) == 0.0


def test_draft_trimming_weighs_a_draft_against_the_whole_step():
    """Unpadded verify steps drop a draft whose expected gain is under its share of the
    step's goodput: the step's period includes the requests' attention, so the context
    keeps a draft that the context-free period would drop (1.02 tokens' draft beside
    1.9's: dropped at 1.04 ms, kept at 2.04)."""
    from specserve.speculative.policy_trim import trim_drafts

    cost = StepCostModel(CurveModel({1: 1.01, 100: 1.99}), None, padded=False)
    cums = [[1.0, 1.9], [1.0, 1.02]]
    assert trim_drafts(cost, cums, [1, 1], 1, 0)[0] == [1, 0]
    cost.context_ms_per_token = 0.001
    lens, tokens, ms = trim_drafts(cost, cums, [1, 1], 1, 0, context=1000)
    assert lens == [1, 1] and ms == pytest.approx(cost.step_ms([1, 1], 0, context=1000))
