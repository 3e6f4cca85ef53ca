"""The goodput policy decides the same with the cost model's memoized read plans as with
direct reads: closed-loop simulations and a recorded sequence of steps with prefill sharing
them, batches changing size, unpadded steps, and cells and switch costs appearing."""

from __future__ import annotations

import random

import pytest

from specserve.spec.acceptance import AcceptanceModel
from specserve.spec.cost_model import CurveModel, StepCostModel
from specserve.spec.policy import GoodputPolicy
from specserve.spec.step_periods import PeriodLog
from tests.policy_sim import LARGE, MEASURED, SMALL, Noise, Workload, simulate

CASES = {
    "measured batch 8": (MEASURED, Workload(8, 2, hard_start=16), Noise(sigma=0.05)),
    "host-bound batch 1": (SMALL, Workload(1, 3), Noise()),
    "GPU-bound batch 64": (LARGE, Workload(64, 1, min_tokens=32, max_tokens=96), Noise()),
}


def _decisions(policy) -> list[tuple]:
    return [(d["k"], d["probe"], d["tokens"], d["period_ms"], d["switch_ms"])
            for d in policy.trace.dump()]  # fmt: skip


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


class _Req:
    def __init__(self, request_id: str, left: int):
        self.request_id, self.left = request_id, left

    @property
    def max_useful_drafts(self) -> int:
        return max(0, self.left - 1)


def _replay(padded: bool, seed: int) -> list[tuple]:
    """A recorded sequence of steps: requests arrive and finish (batch 1 to 24), prefill
    shares some steps, drafts are accepted at random, periods are a noisy function of the
    step (so new cells and switch costs appear along the way)."""
    rng = random.Random(seed)
    target = CurveModel({1: 1.0, 16: 1.1, 64: 1.4, 256: 3.0})
    cost = StepCostModel(target, CurveModel({1: 0.2, 64: 0.3}), padded=padded)
    acceptance = AcceptanceModel(3)
    policy = GoodputPolicy(3, cost, acceptance)
    periods = PeriodLog(cost)
    live, next_id, out = [], 0, []
    for _ in range(1500):
        while len(live) < rng.choice((1, 2, 8, 24)):
            live.append(_Req(f"r{next_id}", rng.randint(2, 120)))
            next_id += 1
        extra = rng.choice((0, 0, 0, 0, 37, 256))
        ks = policy.choose(live, extra)
        out.append((tuple(ks), policy.predicted_tokens, policy.predicted_ms))
        acceptance.update_many([(r.request_id, k, min(k, int(rng.expovariate(0.7))))
                                for r, k in zip(live, ks) if k])  # fmt: skip
        k = max(ks)
        ms = cost.seed_ms(len(live), k) * (1.6 + 0.3 * (k > 0)) * rng.lognormvariate(0, 0.1)
        periods.add(len(live), k, None if extra else ms, None)
        for r, kr in zip(live, ks):
            r.left -= 1 + (kr and rng.randint(0, kr))
        live = [r for r in live if r.left > 0]
        if rng.random() < 0.02:
            live = live[: len(live) // 2]  # aborts
    return out


@pytest.mark.parametrize("padded", (True, False))
def test_recorded_steps_decide_the_same_with_memoized_reads(padded, monkeypatch):
    runs = []
    for memoize in (True, False):
        monkeypatch.setattr(StepCostModel, "memoize", memoize)
        runs.append(_replay(padded, seed=11))
    assert runs[0] == runs[1]
    assert len({max(ks, default=0) for ks, _, _ in runs[0]}) > 1


def test_a_new_cell_changes_what_periods_read():
    """A plan memoized before a cell existed is not read after it appears."""
    cost = StepCostModel(CurveModel({1: 1.0, 64: 2.0}), CurveModel({1: 0.2}), padded=True)
    before = cost.periods_ms(8, 3)
    for _ in range(3):
        cost.observe(8, 3, 2 * cost.seed_ms(8, 3))
    after = cost.periods_ms(8, 3)
    assert after[3] == pytest.approx(2 * before[3])
