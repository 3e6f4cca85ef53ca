"""The goodput policy pays for switching K: a preference change must repay a switch there
and back, probes are spaced by what their switches cost and span enough steps on short
periods, and a request that never drafted is probed while plain decoding is preferred."""

from __future__ import annotations

from dataclasses import replace

from specserve.speculative.acceptance import AcceptanceModel
from specserve.speculative.cost_model import CurveModel, StepCostModel
from specserve.speculative.policy import GoodputPolicy
from tests.support.policy_sim import SMALL, Noise, SimRequest, SimResult, Simulator, Workload

FLAT = CurveModel({1: 1.0, 64: 1.0})


def _policy(alpha: float) -> tuple[GoodputPolicy, AcceptanceModel]:
    acc = AcceptanceModel(3, prior=alpha)
    return GoodputPolicy(3, StepCostModel(FLAT, None, padded=True), acc), acc


class _Req:
    def __init__(self, request_id: str):
        self.request_id, self.max_useful_drafts = request_id, 100


def _measure(policy: GoodputPolicy, up_ms: float, down_ms: float) -> None:
    """Plain steps 1 ms, speculative ones 2 ms; switching to and from plain decoding as
    given."""
    cost = policy.cost
    for k in range(4):
        for _ in range(4):
            cost.observe(1, k, 2.0 if k else 1.0)
    for _ in range(10):
        cost.observe_switch(1, 0, 3, up_ms, 2.0)
        cost.observe_switch(1, 3, 0, down_ms, 1.0)


def test_a_preference_change_repays_a_switch_there_and_back():
    """K=3 is preferred; acceptance drops so that plain decoding is 7% better per step.
    With cheap switches the policy moves; with 3 ms each way (6 ms over 32 steps, about 19%
    of a plain step) it stays."""
    for up_ms, moves in ((0.0, True), (3.0, False)):
        policy, acc = _policy(alpha=0.5)  # K=3: 1.875 tokens per 2 ms, plain: 1 per ms
        _measure(policy, up_ms, up_ms)
        policy._preferred[1] = 3
        for bucket_k in range(4):
            policy._last_run[(1, bucket_k)] = 0
        k = policy.choose([_Req("a")])[0]
        assert (k != 3) == moves, (up_ms, k, policy.trace.dump()[-1])


def test_probe_length_spans_short_periods():
    """The switch, steady steps spanning PROBE_MS (1 to 3), and the step before the switch
    back (it carries part of that switch, so it is no steady sample)."""
    policy, _ = _policy(alpha=0.7)
    assert policy.probe_len(0, 3, 1.0) == 5
    assert policy.probe_len(3, 0, 1.0) == 5
    assert policy.probe_len(2, 3, 2.0) == 4
    assert policy.probe_len(3, 0, 5.0) == 3  # an 8B-sized step: one steady step is enough
    assert policy.probe_len(0, 3, 5.0) == 3


def _plain_probes(eager_ms: float) -> int:
    """Steps spent probing plain decoding at batch 1 while K>0 is preferred, in 3000 steps
    of a host-bound engine whose switches from plain decoding cost eager_ms more."""
    acc = AcceptanceModel(3)
    regime = replace(SMALL, eager_ms=eager_ms, stall_share=0.0, down_share=0.0, early_share=0.0)
    policy = GoodputPolicy(3, regime.seeds(), acc)
    sim = Simulator(policy, acc, regime, Noise(0.1, 0.0), seed=0)
    req = SimRequest("r", 10**9, (0.8, 0.8, 0.85), sim_rng(0))
    result = SimResult()
    for _ in range(3000):
        sim.decode([req], Workload(1, 1, hard_enter=0.0), result)
    return sum(d["probe"] and d["k"] == 0 for d in list(policy.trace.dump())[-2000:])


def sim_rng(seed: int):
    import random

    return random.Random(seed)


def test_probes_are_spaced_by_their_switch_costs():
    cheap, costly = _plain_probes(0.0), _plain_probes(12.0)
    assert cheap >= 2 * max(costly, 1), (cheap, costly)


def test_a_request_that_never_drafted_is_probed_at_plain_decoding():
    """Plain decoding preferred on a pessimistic global estimate: a new request is drafted
    within PROBE_EVERY steps (its own acceptance is unknown); one whose drafts were all
    rejected is not."""
    for seen, probed in ((False, True), (True, False)):
        policy, acc = _policy(alpha=0.35)  # K=3: 1.52 tokens per 2 ms, plain: 1 per ms
        _measure(policy, 0.5, 0.5)
        if seen:
            for _ in range(8):
                acc.update("a", 3, 0)
        for k in range(4):  # all measured lately
            policy._last_run[(1, k)] = 0
        draft_lens = [policy.choose([_Req("a")])[0] for _ in range(policy.PROBE_EVERY + 2)]
        assert (max(draft_lens) > 0) == probed, (seen, draft_lens)
