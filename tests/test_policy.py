"""The goodput policy's decisions on synthetic inputs, and its optimality under its model."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.spec.acceptance import AcceptanceModel
from specserve.spec.cost_model import CurveModel, StepCostModel
from specserve.spec.policy import GoodputPolicy, SchedulePolicy

# shared/DESIGN.md: H200, Llama-3.1-8B shape, step time (ms) by tokens in the step.
H200 = {1: 4.22, 16: 4.44, 64: 4.60, 128: 6.11, 256: 6.91, 512: 12.06, 1024: 22.94, 2048: 45.98}
# An EAGLE-3 head step: one decoder layer and a draft-vocabulary head (about 0.2 ms).
HEAD = {1: 0.20, 64: 0.22, 256: 0.30, 1024: 0.60}


@dataclass
class FakeRequest:
    request_id: str
    max_useful_drafts: int = 100


def _policy(curve=H200, drafter=HEAD, alpha=0.7, k_max=4):
    acc = AcceptanceModel(k_max, prior=alpha)
    cost = StepCostModel(CurveModel(curve), CurveModel(drafter) if drafter else None)
    return GoodputPolicy(k_max, cost, acc), acc


def _reqs(n):
    return [FakeRequest(f"r{i}") for i in range(n)]


def test_flat_cost_speculates_at_k_max():
    policy, _ = _policy(curve={1: 5.0, 4096: 5.0}, drafter=None)
    assert policy.choose(_reqs(16)) == [4] * 16


def test_h200_curve_speculates_at_16_and_stops_at_256():
    policy, _ = _policy(alpha=0.7)
    assert min(policy.choose(_reqs(16))) >= 2
    assert policy.choose(_reqs(256)) == [0] * 256


def test_zero_acceptance_never_speculates():
    policy, _ = _policy(alpha=0.0)
    for n in (1, 16, 64):
        assert policy.choose(_reqs(n)) == [0] * n


def test_mixed_acceptance_gets_mixed_k():
    policy, acc = _policy(alpha=0.7)
    reqs = _reqs(32)
    for _ in range(30):
        for r in reqs[:16]:  # these requests' drafts keep failing
            acc.update(r.request_id, 4, 0)
        for r in reqs[16:]:  # these mostly succeed
            acc.update(r.request_id, 4, 3)
    ks = policy.choose(reqs)
    assert max(ks[:16]) == 0
    assert min(ks[16:]) >= 1


def test_caps_respect_max_useful_drafts():
    policy, _ = _policy(curve={1: 5.0, 4096: 5.0}, drafter=None)
    reqs = [FakeRequest("a", 1), FakeRequest("b", 0)]
    assert policy.choose(reqs) == [1, 0]


def test_schedule_table():
    policy = SchedulePolicy(4, "1:4,16:2,64:0")
    assert policy.choose(_reqs(3)) == [4] * 3
    assert policy.choose(_reqs(20)) == [2] * 20
    assert policy.choose(_reqs(64)) == [0] * 64


def _goodput(policy, alphas, ks, n):
    tokens = 0.0
    for a, k in zip(alphas, ks):
        run = 1.0
        tokens += 1
        for x in a[:k]:
            run *= x
            tokens += run
    return tokens / policy.cost.step_ms(n + sum(ks), ks)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 80),
    alphas=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6),
    scale=st.floats(0.1, 10.0),
)
def test_choice_beats_every_fixed_k(n, alphas, scale):
    """Under its own model, the choice is at least as good as every uniform K."""
    curve = {m: t * scale for m, t in H200.items()}
    policy, acc = _policy(curve=curve, k_max=4)
    reqs = _reqs(n)
    for i, r in enumerate(reqs):
        a = alphas[i % len(alphas)]
        for _ in range(10):
            acc.update(r.request_id, 1, 1 if a > 0.5 else 0)
    ks = policy.choose(reqs)
    per_req = [acc.alpha(r.request_id) for r in reqs]
    best = _goodput(policy, per_req, ks, n)
    for k in range(5):
        assert best >= _goodput(policy, per_req, [k] * n, n) * (1 - 1e-9)


def test_probing_refreshes_estimates_but_stops_for_useless_drafts():
    """A pessimistic estimate gets probed with one draft every PROBE_EVERY steps; drafts
    that keep failing stop being probed."""
    slow_drafter = {1: 2.0, 1024: 2.5}  # e.g. an eager drafter: 2 ms per draft step
    policy, acc = _policy(drafter=slow_drafter, alpha=0.3)  # pessimistic: not worth it
    reqs = _reqs(1)
    chosen = []
    for _ in range(8 * policy.PROBE_EVERY):
        ks = policy.choose(reqs)
        chosen.append(ks[0])
        if ks[0]:
            acc.update("r0", ks[0], ks[0])  # the probe succeeds: acceptance is in fact high
    assert chosen[: policy.PROBE_EVERY - 1] == [0] * (policy.PROBE_EVERY - 1)
    assert max(chosen[-policy.PROBE_EVERY:]) >= 2  # it learned to speculate for real

    policy, acc = _policy(drafter=slow_drafter, alpha=0.3)
    probes = 0
    for _ in range(40 * policy.PROBE_EVERY):
        ks = policy.choose(reqs)
        probes += ks[0] > 0
        if ks[0]:
            acc.update("r0", ks[0], 0)  # every probe fails
    assert 0 < probes < 8
