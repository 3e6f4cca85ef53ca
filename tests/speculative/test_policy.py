"""The goodput policy's decisions on synthetic inputs: its optimality under its model, and
its behaviour in closed loop against step costs that its start-up seeds get wrong."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.speculative.acceptance import AcceptanceModel
from specserve.speculative.cost_model import CurveModel, StepCostModel, batch_bucket
from specserve.speculative.policy import GoodputPolicy, SchedulePolicy
from tests.support.policy_sim import (
    Noise,
    Regime,
    SimRequest,
    SimResult,
    Simulator,
    Workload,
    noise_factors,
)

# shared/DESIGN.md: H200, Llama-3.1-8B shape, step time (ms) by tokens in the step.
H200 = {1: 4.22, 16: 4.44, 64: 4.60, 128: 6.11, 256: 6.91, 512: 12.06, 1024: 22.94, 2048: 45.98}
# An EAGLE-3 head step: one decoder layer and a draft-vocabulary head (about 0.2 ms).
HEAD = {1: 0.20, 64: 0.22, 256: 0.30, 1024: 0.60}
H200_CURVE = CurveModel(H200)


@dataclass
class FakeRequest:
    request_id: str
    max_useful_drafts: int = 100
    drafter_backlog: int = 0


def _policy(curve=H200, drafter=HEAD, alpha=0.7, k_max=4, padded=True):
    acc = AcceptanceModel(k_max, prior=alpha)
    cost = StepCostModel(CurveModel(curve), CurveModel(drafter) if drafter else None, padded)
    return GoodputPolicy(k_max, cost, acc), acc


def _reqs(n):
    return [FakeRequest(f"r{i}") for i in range(n)]


def _measured(policy, n, ratio=1.0):
    """Every K measured at batch n (at ratio x its seed): no exploration is due, so the
    next choice is the model's."""
    for k in range(policy.k_max + 1):
        policy.cost.observe(n, k, policy.cost.seed_ms(n, k) * ratio)
    return policy


def real_ms(n: int, k: int) -> float:
    """Whole-step periods unlike the seeds, shaped like the H200 measurements: a plain step
    has little host overhead; a speculative step pays proposing, verify sampling and
    processing (per request), more at larger K, and drafting is a chain of k passes."""
    if k == 0:
        return H200_CURVE(n) + 0.5 + 0.02 * n
    return H200_CURVE(n * (k + 1)) + 1.5 * k + 2.0 + (0.1 + 0.02 * k) * n


class _Loop:
    """The closed-loop simulator (policy_sim.py) at a constant batch of n requests that
    never end, acceptance `rate` at every position, steady periods from `true_ms` with
    lognormal noise (sigma `noise`), no switch penalty."""

    def __init__(self, policy, acc, n, rate=0.81, seed=0):
        self.sim = Simulator(policy, acc, Regime.steady_only(real_ms), Noise(0.0, 0.0), seed)
        rates = (rate,) * policy.k_max
        self.reqs = [
            SimRequest(f"r{i}", 10**9, rates, random.Random(seed * 1000 + i)) for i in range(n)
        ]
        self.workload = Workload(n, 1, hard_enter=0.0)

    def run(self, steps, true_ms=real_ms, noise=0.0, seed=0):
        """Returns the step Ks and the realized goodput (tokens per ms)."""
        self.sim.regime = Regime.steady_only(true_ms)
        self.sim.noise_at = noise_factors(Noise(noise, 0.0), seed)
        result = SimResult()
        for _ in range(steps):
            self.sim.decode(self.reqs, self.workload, result)
        return result.step_ks, result.tokens / result.ms


def _run(policy, acc, n, steps, **kw):
    return _Loop(policy, acc, n, rate=kw.pop("rate", 0.81)).run(steps, **kw)


def _fixed_goodput(n, k, rate=0.81, true_ms=real_ms):
    return n * (1 - rate ** (k + 1)) / (1 - rate) / true_ms(n, k)


def test_never_clearly_worse_than_plain_or_fixed_k():
    """Seeds that flatter speculation (no host overhead): in closed loop the policy still
    does about as well as the better of plain decoding and K=K_max at every batch size."""
    for n in (1, 8, 64, 256):
        policy, acc = _policy(k_max=3, alpha=0.6)
        _, achieved = _run(policy, acc, n, 600)
        best = max(_fixed_goodput(n, k) for k in (0, 3))
        assert achieved >= 0.95 * best, (n, achieved, best)


def test_expensive_drafting_turns_speculation_off_at_large_batch():
    policy, acc = _policy(k_max=3, alpha=0.81)
    chosen, _ = _run(policy, acc, 64, 600)
    steady = chosen[100:]
    assert steady.count(0) >= 0.9 * len(steady)
    policy, acc = _policy(k_max=3, alpha=0.81)
    chosen, _ = _run(policy, acc, 1, 600)
    assert sum(k >= 2 for k in chosen[100:]) >= 0.9 * 500


def test_uniform_acceptance_gives_uniform_k():
    for padded in (True, False):
        policy, _ = _policy(alpha=0.7, padded=padded)
        for n in (1, 16, 64, 256):
            draft_lens = policy.choose(_reqs(n))
            assert len(set(draft_lens)) == 1, (padded, n, draft_lens)


def test_flat_cost_speculates_at_k_max():
    policy, _ = _policy(curve={1: 5.0, 4096: 5.0}, drafter=None)
    assert _measured(policy, 16).choose(_reqs(16)) == [4] * 16


def test_zero_acceptance_never_speculates_nor_probes():
    policy, acc = _policy(alpha=0.0)
    for n in (1, 16, 64):
        for _ in range(300):
            assert policy.choose(_reqs(n)) == [0] * n


def test_mixed_acceptance_unpadded_trims_poor_requests_padded_does_not():
    for padded in (False, True):
        policy, acc = _policy(alpha=0.7, padded=padded)
        _measured(policy, 32)
        reqs = _reqs(32)
        for _ in range(30):
            for r in reqs[:16]:  # these requests' drafts keep failing
                acc.update(r.request_id, 4, 0)
            for r in reqs[16:]:  # these mostly succeed
                acc.update(r.request_id, 4, 3)
        draft_lens = policy.choose(reqs)
        assert min(draft_lens[16:]) >= 1
        if padded:  # a padded verify step costs the same: shorter drafts would only lose
            assert len(set(draft_lens)) == 1
        else:
            assert max(draft_lens[:16]) == 0


@pytest.mark.parametrize("padded", [False, True])
def test_caps_respect_max_useful_drafts(padded):
    """Unpadded steps cap each request at what it can still commit; padded ones (CUDA
    graphs) give every request the step's K (drafts past a cap cost nothing and keep the
    step uniform), which never exceeds the largest cap."""
    policy, _ = _policy(curve={1: 5.0, 4096: 5.0}, drafter=None, padded=padded)
    reqs = [FakeRequest("a", 1), FakeRequest("b", 0)]
    _measured(policy, 2)
    assert policy.choose(reqs) == ([1, 1] if padded else [1, 0])
    assert policy.predicted_tokens == pytest.approx(
        sum(policy.acceptance.cumulative(r.request_id)[k] for r, k in zip(reqs, (1, 0)))
    )


def test_schedule_table():
    policy = SchedulePolicy(4, "1:4,16:2,64:0")
    assert policy.choose(_reqs(3)) == [4] * 3
    assert policy.choose(_reqs(20)) == [2] * 20
    assert policy.choose(_reqs(64)) == [0] * 64


def test_dormant_probes_measure_k_max_only_within_their_budget():
    """Dormant at batch 64, plain decoding best: a probe drafts on a few requests only, so
    it is priced by their tokens, and only K_max is probed (it measures acceptance at every
    depth): probes of every K, each priced as if every request drafted, took 84 of 2,500
    steps here (2-3% of the throughput at 256 and 512 requests in the serving simulator)."""
    policy, acc = _policy(k_max=3, alpha=0.81)
    chosen, _ = _Loop(policy, acc, 64).run(3000)
    late = chosen[500:]
    assert policy.dormant
    assert set(late) == {0, 3}
    assert sum(1 for k in late if k) <= 0.006 * len(late)


def test_reprobes_and_follows_a_change_in_costs():
    """Settled on plain decoding at batch 64, the policy keeps measuring speculation (at a
    bounded cost) and switches once speculative steps become cheap."""
    policy, acc = _policy(k_max=3, alpha=0.81)
    loop = _Loop(policy, acc, 64)
    chosen, _ = loop.run(2000)
    late = chosen[500:]
    probes = sum(1 for k in late if k)
    assert 0 < probes <= 0.05 * len(late)  # still probed, rarely
    cheap = lambda n, k: 5.0 + 0.1 * k  # noqa: E731 (speculation nearly free now)
    assert policy.dormant and policy.trace.wakes == {}
    chosen, _ = loop.run(1500, true_ms=cheap, seed=1)
    assert chosen[-200:].count(3) >= 180
    assert policy.trace.wakes == {"decode": 1}  # woken once, at a decode-only step


def test_noise_does_not_flap_the_choice():
    """Two K with nearly equal true goodput and 20% noise on every period: the preferred K
    changes rarely."""
    policy, acc = _policy(k_max=3, alpha=0.81)
    flat = lambda n, k: 5.0 * (1 - 0.81 ** (k + 1)) / (1 - 0.81) if k in (2, 3) else 50.0  # noqa: E731
    loop = _Loop(policy, acc, 8)
    loop.run(800, true_ms=flat, noise=0.2)
    switches, last = 0, None
    for i in range(400):
        pref = policy._preferred[batch_bucket(8)]
        switches += last is not None and pref != last
        last = pref
        loop.run(1, true_ms=flat, noise=0.2, seed=i + 1)
    assert switches <= 20


def test_periods_noise_protects_the_k_in_use_only_where_it_could_reverse_the_order():
    """Leaving the K in use takes a gain beyond the periods' standard errors, unless the
    other K takes no longer for no fewer tokens: then their noise cannot reverse the order
    (on a host-paced model K=2 and K=3 steps cost the same, and a noisy estimate that
    pushed the choice to K=2 kept it there for 20-30% of the steps: closed-loop simulator,
    the default model's acceptance on the H200)."""
    policy, _ = _policy(k_max=3)
    policy.cost.error = lambda n, k: 0.2  # noisy periods: a standard error of 28% in all
    tokens, switch = [1.0, 1.5, 1.8, 2.0], [0.0] * 4
    # K=3 as long as K=2, 11% more tokens: it dominates
    assert policy._preferred_k(1, 2, tokens, [0.7, 0.9, 0.9, 0.9], switch, 1) == 3
    # 5% dearer for those tokens: 6% more goodput, within the noise: K=2 stays
    assert policy._preferred_k(1, 2, tokens, [0.7, 0.9, 0.9, 0.945], switch, 1) == 2
    # and K=2 is never left for K=1: fewer tokens for less time, within the noise
    assert policy._preferred_k(1, 2, tokens, [0.7, 0.6, 0.9, 0.9], switch, 1) == 2


def _model_goodput(policy, acc, reqs, draft_lens):
    tokens = sum(acc.expected_tokens(r.request_id, k) for r, k in zip(reqs, draft_lens))
    return tokens / policy.cost.step_ms(draft_lens)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 80),
    alphas=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6),
    scale=st.floats(0.1, 10.0),
    ratios=st.lists(st.floats(0.5, 3.0), min_size=5, max_size=5),
    padded=st.booleans(),
)
def test_choice_beats_every_fixed_k(n, alphas, scale, ratios, padded):
    """Under its own model (measured periods included), the choice is at least as good as
    every uniform K (no probe is due: every cell has been observed just now)."""
    curve = {m: t * scale for m, t in H200.items()}
    policy, acc = _policy(curve=curve, k_max=4, padded=padded)
    reqs = _reqs(n)
    for i, r in enumerate(reqs):
        a = alphas[i % len(alphas)]
        for _ in range(10):
            acc.update(r.request_id, 1, 1 if a > 0.5 else 0)
    for k, ratio in enumerate(ratios):
        policy.cost.observe(n, k, policy.cost.seed_ms(n, k) * ratio)
        policy.cost.observe(n, k, policy.cost.seed_ms(n, k) * ratio)
    draft_lens = policy.choose(reqs)
    best = _model_goodput(policy, acc, reqs, draft_lens)
    for k in range(5):
        assert best >= _model_goodput(policy, acc, reqs, [k] * n) * (1 - 1e-9)


def test_request_probe_refreshes_a_trimmed_request():
    """Unpadded steps where every verify token adds to the step's cost: a request with
    poor acceptance is trimmed, and drafts fully now and then (every REQUEST_PROBE_EVERY
    steps, or sooner once its evidence fades while it does not draft) while its first drafts
    are not useless."""
    linear = {1: 5.05, 4096: 5.0 + 0.05 * 4096}
    policy, acc = _policy(curve=linear, drafter=None, alpha=0.7, padded=False)
    _measured(policy, 32)
    reqs = _reqs(32)
    for _ in range(4):
        for r in reqs[:16]:
            acc.update(r.request_id, 4, 0)
        for r in reqs[16:]:
            acc.update(r.request_id, 4, 4)
    assert acc.alpha("r0")[0] >= policy.PROBE_MIN_ALPHA
    drafted = []
    for _ in range(3 * policy.REQUEST_PROBE_EVERY):
        draft_lens = policy.choose(reqs)
        drafted.append(draft_lens[0])
        acc.update_many(
            [
                (r.request_id, k, 0 if i < 16 else k)
                for i, (r, k) in enumerate(zip(reqs, draft_lens))
                if k
            ]
        )
    assert drafted.count(0) >= 2 * policy.REQUEST_PROBE_EVERY and max(drafted) > 0, drafted


def test_a_burst_starts_dormant_and_wakes_on_evidence_not_on_the_prior():
    """Requests waiting at the first decision (a wave on an idle server): the policy starts
    dormant, so the drafter takes none of the wave's prompts. Dormant, a decision for K > 0
    does not wake it while requests wait for admission; at more requests than a probe
    drafts on it probes on a few rows instead until WAKE_EVIDENCE drafts are verified;
    then the decision wakes it.
    A few requests, or nothing waiting, start awake as before."""
    from specserve.speculative.policy_base import StepLoad

    for n, waiting, dormant in ((64, 10, True), (64, 0, False), (4, 10, True)):
        policy, _ = _policy(k_max=3, alpha=0.9)
        policy.choose(_reqs(n), StepLoad(waiting=waiting, after_idle=True))
        assert policy.dormant == dormant, (n, waiting)
    # a prior that wants drafting, speculative steps cheap: every decision is for K > 0
    cheap = dict(curve={1: 4.0, 4096: 4.2}, drafter={1: 0.01, 4096: 0.02})
    policy, acc = _policy(k_max=3, alpha=0.9, **cheap)
    reqs = [FakeRequest(f"r{i}", drafter_backlog=512) for i in range(64)]  # (prompts unseen)
    assert policy.choose(reqs, StepLoad(waiting=5, after_idle=True)) == [0] * 64
    assert policy.dormant
    assert policy.choose(reqs, StepLoad(waiting=5)) == [0] * 64  # still waiting: no wake
    for load in (StepLoad(prefill_tokens=256, draft_budget=4096), StepLoad()):
        probe = policy.choose(reqs, load)  # no evidence: a probe on a few rows at most
        assert sum(map(bool, probe)) <= policy.DORMANT_PROBE_ROWS and policy.dormant
    assert 0 < sum(map(bool, probe)) and acc.position_drafted[0] == 0
    assert policy.trace.wakes == {}
    acc.update_many([(f"r{i}", 3, 3) for i in range(policy.WAKE_EVIDENCE)])  # (one a request)
    for _ in range(20):  # (after the probe under way)
        if policy.choose(reqs, StepLoad()) == [3] * 64:
            break
    assert not policy.dormant and policy.trace.wakes == {"decode": 1}
    # a K held (settled) before the server idled does not outlast the next burst
    for _ in range(40):
        policy.choose(reqs, StepLoad())
    policy.choose([], StepLoad())
    assert policy.choose(reqs, StepLoad(waiting=5, after_idle=True)) == [0] * 64
    assert policy.dormant and policy.choose(reqs, StepLoad(waiting=5)) == [0] * 64
    # an eager engine (unpadded steps) keeps the drafter awake through a burst: its dormant
    # probes are priced as if every row drafted, and would rarely come due
    policy, _ = _policy(k_max=3, alpha=0.9, padded=False, **cheap)
    policy.choose(reqs, StepLoad(waiting=5, after_idle=True))
    assert not policy.dormant
