"""What the goodput policy learns from: which step periods are steady samples of a K and what
a switch costs (PeriodLog, with one step of hindsight), and per-request acceptance estimates
that neither collapse on one rejection nor freeze while a request does not draft."""

from __future__ import annotations

from specserve.core.batch import ScheduledRequest
from specserve.speculative.acceptance import AcceptanceModel
from specserve.speculative.cost_model import CurveModel, StepCostModel
from specserve.speculative.policy import GoodputPolicy
from specserve.speculative.speculator import Speculator
from specserve.speculative.step_periods import PeriodLog

FLAT = CurveModel({1: 1.0, 64: 1.0})


def _policy() -> tuple[GoodputPolicy, AcceptanceModel]:
    acc = AcceptanceModel(3)
    return GoodputPolicy(3, StepCostModel(FLAT, None, padded=True), acc), acc


def test_speculator_records_steady_step_periods_only():
    """Periods run from one step's tokens on the host to the next one's. Decode-only steps
    form a chain (a step with prefill, or after an idle engine, ends it); with one step of
    hindsight a step is steady (recorded under (decoding requests, K)) only when the steps
    before and after it in the chain run the same K. The step before a change of K and the
    first at the new K belong to the switch: their excess over the steady steps on either
    side is its cost (negative here: the step before the switch was short). Each period
    joins its decision in the trace."""
    spec = Speculator.__new__(Speculator)
    policy, _ = _policy()
    spec.policy, spec.cost, spec.periods = policy, policy.cost, PeriodLog(policy.cost)
    spec.clear_step_history()
    spec._last_committed = 4
    seen = []
    policy.cost.observe = lambda n, k, ms, context=0: seen.append((n, k, round(ms, 6)))
    policy.cost.observe_switch = lambda n, k0, k, ms, steady: seen.append(
        ("switch", n, k0, k, round(ms, 6), round(steady, 6))
    )

    def step(k, resolved_s, n=4, prefill=False, after_idle=False):
        batch = []
        for _ in range(n):
            s = ScheduledRequest(None, 1, k, decoding=True)
            s.drafts = [0] * k
            batch.append(s)
        policy._decided([k] * n)
        if prefill:
            batch.append(ScheduledRequest(None, 16))
        spec.observe_period(batch, resolved_s, after_idle)

    step(3, 1.000)  # the chain's first step: no period
    step(3, 1.010)  # 10 ms: steady once the next step shows K=3
    step(3, 1.020)  # steady
    step(3, 1.028)  # 8 ms, the step before the switch
    step(0, 1.033)  # the switch: 5 ms
    step(0, 1.037)  # 4 ms: steady, and the switch cost (8 - 10) + (5 - 4) = -1 ms
    step(0, 1.041)  # the chain's last: its successor has prefill
    step(0, 1.051, prefill=True)  # not decode-only
    step(0, 1.056)  # after a prefill step: starts a chain
    step(0, 2.000, after_idle=True)  # after an idle engine: starts a chain
    step(0, 2.004, n=2)  # steady, two requests: 4 ms
    step(0, 2.008, n=2)  # not classified yet
    assert seen == [
        (4, 3, 10.0),
        (4, 3, 10.0),
        (4, 0, 4.0),
        ("switch", 4, 3, 0, -1.0, 4.0),
        (2, 0, 4.0),
    ]
    recorded = [
        (d["k"], d["recorded"], round(d["observed_ms"] or 0, 6)) for d in policy.trace.dump()
    ]
    assert recorded == [
        (3, "", 0),
        (3, "steady", 10.0),
        (3, "steady", 10.0),
        (3, "before_switch", 8.0),
        (0, "switch", 5.0),
        (0, "steady", 4.0),
        (0, "", 4.0),
        (0, "", 10.0),
        (0, "", 5.0),
        (0, "", 0),
        (0, "steady", 4.0),
        (0, "", 4.0),
    ]
    assert policy.trace.switches == 1 and policy.trace.k_changes == 1
    # plain steps with prefill apart: the one step above (10 ms), none dormant; the
    # decode-only ones with the drafter kept up are "awake" (5 + 4 + 4 + 5 + 4 + 4 ms)
    assert policy.trace.plain_steps_by_part == {"prefill": 1, "awake": 6}
    assert round(policy.trace.plain_ms_by_part["prefill"], 6) == 10.0
    assert round(policy.trace.plain_ms_by_part["awake"], 6) == 26.0
    policy.dormant = True  # the drafter's upkeep stopped: plain steps count as dormant
    step(0, 2.013, n=2)
    step(0, 2.020, n=2, prefill=True)
    assert policy.trace.plain_steps_by_part == {"prefill": 2, "dormant": 2, "awake": 6}
    assert round(policy.trace.plain_ms_by_part["dormant"], 6) == 12.0


def test_a_switch_costs_the_excess_of_the_steps_around_it():
    """Run 5 on the H200, batch 1: the plain step before drafting resumed took 4-5 ms more
    than a plain one (the drafter's catch-up, launched inside it), the first drafting step
    about a steady one; the drafting step before plain decoding 0.6 ms less. Recorded as
    +4.3 ms up and -0.6 ms down, and no short or long step as a steady sample."""
    cost = StepCostModel(FLAT, None, padded=True)
    log = PeriodLog(cost)
    periods = [(0, 0.975)] * 4 + [(0, 5.3)] + [(3, 1.78)] + [(3, 1.82)] * 4 + [(3, 1.22)]
    periods += [(0, 0.80)] + [(0, 0.975)] * 4
    log.add(1, 0, None, None)
    for k, ms in periods:
        log.add(1, k, ms, None)
    sw = cost.switch_costs(1)
    # the first sample replaces the prior (half a plain step: 0.49 ms, where the engine's
    # way back measured 4.3; averaged with it, a host-bound engine's probes were underpriced)
    assert abs(sw["up"] - 4.29) < 0.01
    assert abs(sw["down"] - (-0.6 - 0.175)) < 0.01
    assert abs(cost.period_ms(1, 3) - 1.82) < 0.01 and abs(cost.period_ms(1, 0) - 0.975) < 0.01


def _history(acc: AcceptanceModel, steps: int = 50, start: int = 0) -> None:
    """Other requests' verify steps: 3 drafts, 70-75% accepted at each position."""
    for i in range(start, start + steps):
        acc.update(f"other{i}", 3, (0, 1, 2, 3, 3, 3, 3, 3, 2, 1)[i % 10])


def test_one_rejection_does_not_turn_a_request_off():
    """A new request's estimate is the global one with a prior of 8 observations: one
    rejected first draft costs it a little (with 2, as in run 5, it fell from 0.72 to 0.48,
    and plain decoding won at batch 1)."""
    acc = AcceptanceModel(3)
    _history(acc)
    g = acc.global_alpha[0]
    acc.update("r", 3, 0)
    assert acc.alpha("r")[0] > 0.8 * g  # (with a prior of 2 observations: 2/3 g)


def test_an_estimate_fades_back_while_the_request_does_not_draft():
    """Acceptance drifts along a text (a hard opening): a request's own evidence fades while
    it does not draft, so a request turned off by a bad stretch returns to the global estimate
    and is drafted again; one that keeps drafting keeps its own."""
    acc = AcceptanceModel(3)
    _history(acc)
    for _ in range(6):
        acc.update("bad start", 3, 0)
        acc.update("drafting", 3, 0)
    low = acc.alpha("bad start")[0]
    for step in range(60):
        acc.tick()
        acc.update("drafting", 3, 0)
        _history(acc, 3, start=3 * step)
    g = acc.global_alpha[0]
    assert acc.alpha("drafting")[0] <= low < g - 0.2
    assert acc.alpha("bad start")[0] > (low + g) / 2  # more than half way back
