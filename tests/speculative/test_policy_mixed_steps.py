"""The goodput policy in steps that carry prefill: K ranked by the tokens it adds beyond their
cost at the server's running rate weighted by decoding rows, never below its average (not
by the step's own tokens per ms, which its prefill dilutes), the prefill its extra commits
bring priced in, no probes (a mixed step measures no K), and drafts within the budget the
scheduler leaves."""

from __future__ import annotations

import pytest

from specserve.speculative.buckets import batch_bucket
from specserve.speculative.policy import StepLoad
from specserve.speculative.serving_rate import DrafterUpkeep, DraftingSurcharge, PrefillRuns
from tests.speculative.test_policy import _measured, _policy, _reqs

N, PREFILL = 64, 1984  # 64 decode rows beside a prefill chunk filling a 2048-token budget


def _running(policy, rate: float, steps: int = 16):
    for _ in range(steps):  # the server's running rate, tokens per ms
        policy.observe_rate(round(rate * 10), 10.0)
    return policy


def _mixed_choice(rate: float, per_token: float = 0.0, occupancy: float = 1.0) -> int:
    policy, _ = _policy(alpha=0.8, k_max=3)
    _measured(policy, N)
    _running(policy, rate)
    load = StepLoad(PREFILL, draft_budget=None, prefill_per_token=per_token, occupancy=occupancy)
    draft_lens = policy.choose(_reqs(N), load)
    assert len(set(draft_lens)) == 1
    return draft_lens[0]


def test_a_mixed_step_drafts_when_its_extra_tokens_beat_the_running_rate():
    # K=3 adds about 120 expected tokens for about 5 ms of verify rows and drafting beside a
    # 46 ms prefill step: worth it at 10 tokens/ms, not at 40. The step's own tokens per ms
    # (about 3.6 at K=3 against 1.4 plain) would draft at either rate.
    assert _mixed_choice(rate=10.0) == 3
    assert _mixed_choice(rate=40.0) == 0


def test_a_millisecond_is_priced_where_requests_decode():
    """Steps weigh in the price by their decoding rows (ServingRate.per_row): in waves, a
    wave's prefill steps (few rows, few tokens, long) drag the running rate down while the
    tokens drafts save come off decode steps at the full batch. Here 1 in 4 steps is
    prefill with 2 rows (2 tokens in 40 ms), the rest decode 64 rows (64 tokens in 1 ms):
    the running rate is 4.5 tokens/ms, where K=3 would pay (as at 10 above); by rows it is
    45, where it does not (as at 40)."""
    policy, _ = _policy(alpha=0.8, k_max=3)
    _measured(policy, N)
    for i in range(256):
        if i % 4:
            policy.observe_rate(64, 1.0, rows=64)
        else:
            policy.observe_rate(2, 40.0, rows=2)
    assert policy.rate.value < 5.0 and policy.rate.per_row > 40.0
    assert policy.choose(_reqs(N), StepLoad(PREFILL, draft_budget=None)) == [0] * N


def test_a_millisecond_is_priced_at_no_less_than_the_servers_rate():
    """The other way round (ServingRate.price): where the steps full of rows are the slow
    ones (long prefill steps that drafts beside them made longer), weighing by rows prices
    a ms below what the server makes of one on average, and drafts beside prefill that
    earn less than that average look worth it: the price is never below `value`. Here 1
    step in 16 carries 64 rows (64 tokens in 10 ms), the rest 8 rows that accept every
    draft (32 tokens in 0.25 ms): by rows 11.8 tokens/ms, where K=3 would pay (as at 10
    above), on average 39.6, where it does not (as at 40)."""
    policy, _ = _policy(alpha=0.8, k_max=3)
    _measured(policy, N)
    for i in range(512):
        if i % 16:
            policy.observe_rate(32, 0.25, rows=8)
        else:
            policy.observe_rate(64, 10.0, rows=64)
    rate = policy.rate
    assert rate.per_row < 12.0 and rate.price > 38.0
    assert rate.snapshot() == {"prefill_price_tokens_per_s": rate.price * 1e3}
    assert policy.choose(_reqs(N), StepLoad(PREFILL, draft_budget=None)) == [0] * N


def test_the_prefill_extra_commits_bring_is_priced():
    # at 8 prompt tokens per generated token (long prompts, short answers) each committed
    # token brings 8 prefill tokens (about 0.18 ms at the full GEMM slope): K=3's extra
    # tokens no longer pay at 10 tokens/ms ... while with no ratio known (nothing finished
    # yet) they do
    assert _mixed_choice(rate=10.0, per_token=8.0) == 0
    assert _mixed_choice(rate=10.0, per_token=0.0) == 3


def test_the_prefill_commits_bring_is_charged_by_the_servers_occupancy():
    # Where the running requests hold under half of the server's room, arrivals are admitted
    # whatever K does: the charge shrinks in proportion (GoodputPolicy.FULL_CHARGE_OCCUPANCY)
    # and at a twentieth of the room (a tenth of the charge) K=3 pays again at 8 prompt
    # tokens per generated token; at a fifth, two fifths of the charge keep it off (a fifth
    # would not); from half the room up the whole charge counts, as in a full server
    assert _mixed_choice(rate=10.0, per_token=8.0, occupancy=0.05) == 3
    assert _mixed_choice(rate=10.0, per_token=8.0, occupancy=0.2) == 0
    assert _mixed_choice(rate=10.0, per_token=8.0 / 5) == 3
    assert _mixed_choice(rate=10.0, per_token=8.0, occupancy=0.9) == 0


def test_no_marginal_rule_before_the_rate_is_known():
    # A server whose first steps were prefill only (nothing committed) knows no rate yet: the
    # step's own ranking decides. "tokens - 0 x ms" would always draft K_max; at an
    # acceptance of 0.1 K=3 adds about 7 tokens for 5.6 ms, which the ratio declines (it
    # takes K=1, the prefill diluting its cost); the marginal rule, once the rate is known,
    # declines drafting at all.
    for observed in ([], [(0, 10.0)], [(0, 10.0)] * 40):
        policy, _ = _policy(alpha=0.1, k_max=3)
        _measured(policy, N)
        for committed, ms in observed:
            policy.observe_rate(committed, ms)
        assert not policy.rate.ready
        assert max(policy.choose(_reqs(N), StepLoad(PREFILL))) < 3
    policy, _ = _policy(alpha=0.1, k_max=3)
    policy = _running(_measured(policy, N), 10.0)
    assert policy.rate.ready and policy.choose(_reqs(N), StepLoad(PREFILL)) == [0] * N


def test_a_budget_forced_plain_step_is_no_decision():
    policy, _ = _policy(alpha=0.8, k_max=3)
    _measured(policy, N)
    assert policy.choose(_reqs(N)) == [3] * N  # decode-only: K=3 in use
    switches = policy.trace.switches
    assert policy.choose(_reqs(N), StepLoad(1990, draft_budget=58)) == [0] * N  # no budget
    assert policy._running_k == 3  # the K in use stays: no switch to pay back
    assert policy.choose(_reqs(N)) == [3] * N
    assert policy.trace.switches - switches <= 2  # (the trace counts the K=0 step it ran)


def test_no_probe_in_a_mixed_step_and_drafts_within_the_budget():
    policy, _ = _policy(alpha=0.8, k_max=3)
    _measured(policy, N)
    _running(policy, 10.0)
    probes = policy.trace.probe_steps
    for _ in range(300):  # decode-only steps this many would have probed every K by now
        draft_lens = policy.choose(_reqs(N), StepLoad(PREFILL, draft_budget=N * 2))
        assert max(draft_lens) <= 2  # 128 tokens of budget for 64 requests
    assert policy.trace.probe_steps == probes
    for _ in range(300):
        policy.choose(_reqs(N))
    assert policy.trace.probe_steps > probes  # decode-only steps still probe


def test_a_mixed_step_plain_by_the_marginal_rule_is_not_overruled_by_the_modes():
    """The modes' factors are measured on decode-only steps; in a step carrying prefill the
    chunk's time sits in every K's period, so drafting's tokens per ms look far better than
    plain decoding's there (about 2.7x at K=3 here) and drafting's factor measured a little
    above plain's (1.1 against 1.0) overruled the marginal rule's K=0: on the H100 at 256
    and 512 requests, acceptance 1.5, it woke the dormant drafter 1-3 times a point, each
    waking it on the whole batch. Decode-only steps still get the overrule."""
    from specserve.speculative.mode_rates import ModeRates

    for dormant in (False, True):
        policy, _ = _policy(alpha=0.8, k_max=3)
        _running(_measured(policy, N), 40.0)
        modes = ModeRates()  # drafting delivered 10% more than expected, plain as expected
        for i in range(ModeRates.MIN_STEPS):
            modes.observe(N, "plain", 1.0, 1.0, 1.0, 1.0, policy.num_steps - i)
            modes.observe(N, "drafting", 1.1, 1.0, 1.0, 1.0, policy.num_steps - i)
        policy.modes, policy._settled = modes, None
        if dormant:
            policy.dormant, policy._plain_decisions = True, policy.DORMANT_AFTER
        assert policy.choose(_reqs(N), StepLoad(PREFILL)) == [0] * N
        assert modes.num_favored == 0 and policy.dormant == dormant
        assert policy.trace.wakes == {}


def test_drafting_surcharge_is_measured_against_plain_prefill_steps():
    s = DraftingSurcharge()
    for _ in range(DraftingSurcharge.MIN_STEPS - 1):
        s.observe(True, 30.0, 20.0)
    assert s.ms == 0.0  # not yet measured: nothing
    s.observe(True, 30.0, 20.0)
    assert s.ms == 10.0  # plain prefill steps unmeasured: their residual counts as 0
    for _ in range(200):
        s.observe(False, 24.0, 20.0)  # the model underestimates every prefill step by 4
    assert abs(s.ms - 6.0) < 1e-6
    for _ in range(200):
        s.observe(False, 35.0, 20.0)  # ... by more than drafting's: no negative surcharge
    assert s.ms == 0.0
    assert s.snapshot() == {"prefill_surcharge_ms": 0.0}
    # probes of drafting beside prefill: MIN_EVERY steps apart while nothing is priced, else
    # as many as keep them (each costing the surcharge) within PROBE_BUDGET of those steps
    low = DraftingSurcharge.MIN_EVERY
    due = [s.due(20.0) for _ in range(3 * low)]
    assert sum(due) == 3 and due[low - 1]
    for _ in range(200):
        s.observe(False, 20.0, 20.0)  # the model right about plain prefill steps: 10 ms
    assert abs(s.ms - 10.0) < 0.05
    # a new surcharge is probed MIN_EVERY steps on, then twice as far each time, up to as
    # far as the budget allows: 10 ms / (0.5% of 20 ms) = 100
    assert s.every(20.0) == low
    s._since = 0
    due = [s.due(20.0) for _ in range(300)]
    assert [i for i, d in enumerate(due) if d] == [low - 1, 3 * low - 1, 7 * low - 1, 7 * low + 99]
    assert s.every(20.0) == 100 and s.every(200.0) == low
    assert s.every(1.0) == DraftingSurcharge.MAX_EVERY


def test_a_probe_after_a_gap_stands_for_the_gap():
    """A surcharge from a burst of slow drafting steps beside prefill (a transient: a fresh
    point's first such steps through the server on an H100, session 60, spanned 7.4 ms on
    the device against 2.6 for decode-only ones, and locked every prefill step of the
    point plain) is re-measured by the first probe: an observation weighs WEIGHT for each
    deliberation of a step carrying prefill since its kind was last observed, up to
    replacing the mean, so a probe after MIN_EVERY deliberations without drafting there
    stands for all of them."""
    s = DraftingSurcharge()
    for _ in range(8):
        s.observe(False, 22.0, 20.0)
    for _ in range(DraftingSurcharge.MIN_STEPS):
        s.observe(True, 30.0, 20.0)  # the transient
    assert s.ms == pytest.approx(8.0)
    for _ in range(DraftingSurcharge.MIN_EVERY - 1):
        assert not s.due(20.0)
        s.observe(False, 22.0, 20.0)  # plain steps beside prefill, deliberated
    assert s.due(20.0)  # the probe
    s.observe(True, 22.0, 20.0)  # drafting there costs what plain decoding does
    assert s.ms == 0.0
    # one slow drafting step among frequent ones moves the mean by WEIGHT only
    s.due(20.0)
    s.observe(True, 30.0, 20.0)
    assert 0 < s.ms <= 8.0 / (DraftingSurcharge.MIN_STEPS + 2)  # (the 6th: 1/6, then 1/8)


def test_a_mixed_step_prices_the_measured_surcharge_and_probes_without_it():
    """A measured surcharge of drafting beside prefill turns a mixed step that drafted K=3 at
    10 tokens/ms (the test above) to plain decoding, except the probes (`due`), which leave
    it out so that drafting there is measured again; decode-only steps do not pay it."""
    policy, _ = _policy(alpha=0.8, k_max=3)
    _measured(policy, N)
    _running(policy, 10.0)
    for _ in range(8):  # drafting beside prefill took 40 ms more than the model said
        policy.surcharge.observe(True, 100.0, 60.0)
    step_ms = policy.cost.step_ms([0] * N, PREFILL)
    low = DraftingSurcharge.MIN_EVERY
    assert policy.surcharge.every(step_ms) == low  # new: re-measured soon
    choices = [
        policy.choose(_reqs(N), StepLoad(PREFILL, draft_budget=None))[0] for _ in range(3 * low)
    ]
    assert choices.count(3) == 2 and set(choices) == {0, 3}
    assert choices[low - 1] == 3 and choices[3 * low - 1] == 3  # then twice as far
    assert low < policy.surcharge.every(step_ms) < DraftingSurcharge.MAX_EVERY
    assert policy.choose(_reqs(N))[0] == 3  # decode-only: the surcharge is not there


def test_a_surcharged_plain_prefill_step_holds_nothing_for_decode_steps():
    """A step carrying prefill that the surcharge alone turns plain does not start a hold
    of plain decoding (a K=0 decision far from drafting is repeated without deliberating,
    decode-only steps included): the holds compare the model's periods."""
    policy, _ = _policy(alpha=0.8, k_max=3)
    _measured(policy, N)
    _running(policy, 10.0)
    for _ in range(8):  # drafting beside prefill took 400 ms more than the model said
        policy.surcharge.observe(True, 460.0, 60.0)
    assert policy.choose(_reqs(N), StepLoad(PREFILL, draft_budget=None))[0] == 0
    assert policy._settled is None
    assert policy.choose(_reqs(N))[0] == 3


def test_the_surcharge_observes_each_prefill_step_by_its_period():
    """Through the speculator: a step carrying prefill goes to the surcharge with its
    period, not its device span, against its decision's prediction, plain ones between
    drafting steps included, only where it ran the K decided. Left out: a drafting step
    after a plain one (its period holds the rows' catch-up, a switch's cost), a plain step
    the drafter was not kept up in as launched (dormant: no upkeep), steps after an idle
    engine or a wait for the step before."""
    from specserve.core.batch import ScheduledRequest
    from specserve.speculative.speculator import Speculator
    from specserve.speculative.step_periods import PeriodLog

    policy, _ = _policy(alpha=0.8, k_max=3)
    spec = Speculator.__new__(Speculator)
    spec.policy, spec.cost, spec.periods = policy, policy.cost, PeriodLog(policy.cost)
    spec.clear_step_history()
    seen = []
    policy.surcharge.observe = lambda drafted, ms, predicted: seen.append(
        (drafted, round(ms, 3), predicted)
    )
    clock = [1.0]

    def step(k, ms, prefill=False, decided_k=None, device_ms=None, **launched):
        batch = []
        for _ in range(4):
            s = ScheduledRequest(None, 1, k, decoding=True)
            s.drafts = [0] * k
            batch.append(s)
        if prefill:
            batch.append(ScheduledRequest(None, 16))
        policy._decided([k if decided_k is None else decided_k] * 4, step_ms=5.0)
        clock[0] += ms / 1e3
        after_idle = launched.pop("after_idle", False)
        spec.observe_period(batch, clock[0], after_idle, device_ms, **launched)

    step(1, 2.0)
    step(1, 9.0, prefill=True, device_ms=8.0)  # drafting after drafting: its period
    assert seen == [(True, 9.0, 5.0)]
    step(0, 8.0, prefill=True, device_ms=6.0)  # plain between drafting steps: its period
    step(1, 9.0, prefill=True, device_ms=8.5)  # drafting after plain: the catch-up, no
    step(1, 7.0, prefill=True)  # untimed (the simulators' synchronous steps): the period
    step(1, 9.0, prefill=True, decided_k=3, device_ms=8.0)  # ran K=1, K=3 decided: no
    step(1, 2.0, device_ms=2.0)  # decode-only: no
    step(0, 8.0, prefill=True, device_ms=6.0, kept_drafter=False)  # dormant as launched: no
    policy.dormant = True  # dormant now, but kept up as launched (overlap): yes
    step(0, 8.0, prefill=True, device_ms=5.5, kept_drafter=True)
    policy.dormant = False
    step(1, 2.0)
    step(1, 9.0, prefill=True, device_ms=8.0, waited=True)  # after a wait: no
    step(1, 9.0, prefill=True, device_ms=8.0, after_idle=True)  # after an idle engine: no
    assert seen == [(True, 9.0, 5.0), (False, 8.0, 5.0), (True, 7.0, 5.0), (False, 8.0, 5.0)]


def test_a_host_bound_engine_drafts_beside_prefill_where_periods_say_it_costs_nothing():
    """The default model through the server on an H100 (session 60): steps carrying prefill
    overran the model by about 2.8 ms of period plain and 1.4 drafting, while their device
    spans said drafting added 0.9 ms there (the host paces those steps, the device waits
    for it). Priced by spans, goodput kept most of them plain, for fewer tokens in the
    same time (0.82-0.91 of fixed K=3); by periods, what the policy ranks K by, drafting
    adds nothing there and the step carrying prefill drafts as the decode-only ones do."""
    from specserve.core.batch import ScheduledRequest
    from specserve.speculative.speculator import Speculator
    from specserve.speculative.step_periods import PeriodLog

    policy, _ = _policy(alpha=0.8, k_max=3)
    _measured(policy, N)
    _running(policy, 10.0)
    spec = Speculator.__new__(Speculator)
    spec.policy, spec.cost, spec.periods = policy, policy.cost, PeriodLog(policy.cost)
    spec.clear_step_history()
    clock = [1.0]

    def step(k, predicted, period, span):
        batch = []
        for _ in range(N):
            s = ScheduledRequest(None, 1, k, decoding=True)
            s.drafts = [0] * k
            batch.append(s)
        batch.append(ScheduledRequest(None, 16))
        policy._decided([k] * N, step_ms=predicted)
        clock[0] += period / 1e3
        spec.observe_period(batch, clock[0], False, span)

    for _ in range(8):  # drafting after drafting, then plain between drafting steps
        step(3, 4.0, 5.4, 4.6)
        step(3, 4.0, 5.4, 4.6)
        step(0, 2.8, 5.6, 2.7)
    assert policy.surcharge.ms == 0.0
    assert policy.choose(_reqs(N))[0] == 3  # decode-only: drafting
    assert policy.choose(_reqs(N), StepLoad(PREFILL, draft_budget=None))[0] == 3


def _surcharged_prefill_choice(switch_up_ms: float | None) -> int:
    """K for a step carrying prefill while decode-only steps draft K=3 and a measured 10 ms
    surcharge of drafting beside prefill makes plain decoding better for that step alone
    (at 10 tokens/ms K=3 adds ~120 tokens for ~15 ms); `switch_up_ms`: back to drafting from
    plain decoding costs this much at the batch's bucket, measured (None: not measured)."""
    policy, _ = _policy(alpha=0.8, k_max=3)
    _measured(policy, N)
    _running(policy, 10.0)
    for _ in range(8):
        policy.surcharge.observe(True, 70.0, 60.0)
    if switch_up_ms is not None:
        steady = policy.cost.period_ms(N, 3)
        for _ in range(4):
            policy.cost.observe_switch(N, 0, 3, switch_up_ms, steady)
            policy.cost.observe_switch(N, 3, 0, 0.0, steady)
    assert policy.choose(_reqs(N))[0] == 3  # decode-only: drafting
    return policy.choose(_reqs(N), StepLoad(PREFILL, draft_budget=None))[0]


def test_a_prefill_step_leaving_the_decode_steps_k_pays_its_switch_back_in_full():
    """A step carrying prefill that leaves the K decode-only steps would keep is followed by
    a switch back at the next decode step: with switches measured at its bucket (here 20 ms
    back to drafting: the drafter's catch-up), that step pays the switch there and back in
    full, over the run of steps carrying prefill (`PrefillRuns`: 1 here), not spread over
    DWELL_STEPS as a decode step's switch is. At 64 clients of the default model on an H100
    goodput left drafting for each such step and came back at once (3,417 switches in
    3,877 steps). Unmeasured switches (a prior) keep the spread."""
    assert _surcharged_prefill_choice(20.0) == 3
    assert _surcharged_prefill_choice(None) == 0
    assert _surcharged_prefill_choice(0.0) == 0  # measured, and free: plain beside prefill


def test_prefill_runs():
    """How long a K chosen beside prefill lasts: the mean run of decisions carrying prefill,
    the current run where longer, at least 1 and at most the cap."""
    runs = PrefillRuns()
    assert runs.dwell(32) == 1.0
    for carries in (True, False, True, True, True, False):
        runs.observe(carries)
    assert runs.runs == 2 and runs.mean == 2.0 and runs.dwell(32) == 2.0
    for _ in range(5):
        runs.observe(True)
    assert runs.dwell(32) == 5.0 and runs.dwell(4) == 4.0

    # and how many decisions carry prefill: 2 in 6 of these tens, then 1 in 3 (a decode-only
    # step for every two carrying prefill: what drafting pays the drafter's upkeep for)
    runs = PrefillRuns()
    for i in range(600):
        runs.observe(i % 3 != 0)
    assert runs.share == pytest.approx(2 / 3, abs=0.01)
    assert runs.per_decode_step == pytest.approx(2.0, abs=0.1)
    for _ in range(2000):
        runs.observe(True)
    assert runs.per_decode_step == pytest.approx(9.0)  # (at most MAX_SHARE)


def test_the_drafters_upkeep_is_what_the_host_had_no_time_to_spare_for():
    upkeep = DrafterUpkeep()
    for _ in range(DrafterUpkeep.MIN_STEPS - 1):
        upkeep.observe(1.5)
    assert upkeep.ms == 0.0  # not yet measured
    upkeep.observe(1.5)
    assert upkeep.ms == pytest.approx(1.5)
    for _ in range(200):  # (an EWMA over about 1 / WEIGHT steps)
        upkeep.observe(0.5)
    assert upkeep.ms == pytest.approx(0.5, abs=1e-4)
    assert upkeep.snapshot() == {"prefill_upkeep_ms": upkeep.ms}


def _upkept_choice(upkeep_ms: float, prefill_every: int = 3) -> int:
    """K for a decode-only step of N requests where K=2 leads plain decoding by 16% under
    the cost model, with the drafter's upkeep beside prefill measured at `upkeep_ms` and
    one step in `prefill_every` carrying prefill."""
    policy, _ = _policy(alpha=0.5, k_max=3)
    _measured(policy, N)
    for i in range(600):
        policy.prefill_runs.observe(i % prefill_every == 0)
    for _ in range(DrafterUpkeep.MIN_STEPS):
        policy.upkeep.observe(upkeep_ms)
    return policy.choose(_reqs(N))[0]


def test_drafting_pays_the_drafters_upkeep_beside_prefill_on_decode_steps():
    """Plain decoding with the drafter dormant skips its upkeep beside prefill, which the
    modes' factors (decode-only steps) and the cost model (steady steps) never see: a
    decode-only step charges each K > 0 that upkeep for every step carrying prefill there is
    to a decode-only one (here 1 in 3: half a step's upkeep). The default model's engine on
    machine B's clock at 64 clients (every K ties on decode-only steps, a kept-up plain step
    carrying prefill 1.45 ms dearer): 0.899 of plain decoding before, 0.996 charged (the
    serving test of that clock)."""
    assert _upkept_choice(0.0) == 2
    assert _upkept_choice(1.0) == 2  # 0.5 ms more a K = 2 step of ~7 ms: still 8% ahead
    assert _upkept_choice(4.0) == 0  # 2 ms more: plain decoding
    assert _upkept_choice(4.0, prefill_every=50) == 2  # prefill rare: 0.08 ms more


def test_a_step_carrying_prefill_pays_the_upkeep_only_where_it_keeps_the_drafter_awake():
    """Beside prefill the upkeep is paid at every K while the drafter is kept up: a step
    carrying prefill charges it to K > 0 only where its decode steps prefer plain
    decoding (drafting there would keep the drafter from sleeping) or it sleeps."""

    def choice(preferred: int) -> int:
        policy, _ = _policy(alpha=0.8, k_max=3)
        _measured(policy, N)
        _running(policy, 10.0)  # K=3 adds ~120 tokens for ~5 ms beside the prefill
        for _ in range(DrafterUpkeep.MIN_STEPS):
            policy.upkeep.observe(10.0)
        policy._preferred[batch_bucket(N)] = preferred
        return policy.choose(_reqs(N), StepLoad(PREFILL, draft_budget=None))[0]

    assert choice(3) == 3  # the upkeep is paid whatever this step does
    assert choice(0) == 0  # 10 ms more for K > 0: plain, towards dormancy


def test_the_upkeep_is_observed_where_the_drafter_was_kept_up_beside_prefill():
    """Through the speculator: a step carrying prefill, decode rows and the drafter kept up
    (as launched) gives the upkeep its host time less the host's wait for the step's tokens
    (time it had to spare), never below 0; the decision records both. A step the drafter
    was not kept up in (dormant as launched) or without prefill gives none."""
    from specserve.core.batch import ScheduledRequest
    from specserve.speculative.speculator import Speculator
    from specserve.speculative.step_periods import PeriodLog

    policy, _ = _policy(alpha=0.8, k_max=3)
    spec = Speculator.__new__(Speculator)
    spec.policy, spec.cost, spec.periods = policy, policy.cost, PeriodLog(policy.cost)
    spec.clear_step_history()
    seen = []
    policy.upkeep.observe = seen.append
    clock = [1.0]

    def step(k, upkeep, prefill=True, kept_drafter=True):
        batch = [ScheduledRequest(None, 1, k, decoding=True) for _ in range(4)]
        batch += [ScheduledRequest(None, 16)] * prefill
        policy._decided([k] * 4)
        clock[0] += 4.0 / 1e3
        spec.observe_period(batch, clock[0], False, kept_drafter=kept_drafter, upkeep=upkeep)
        return policy.trace.recent[-1]

    decision = step(0, (1.5, 0.25))
    assert (decision.upkeep_ms, decision.wait_ms) == (1.5, 0.25)
    step(3, (0.75, 2.0))  # the host waited longer than the upkeep took: it was free
    step(0, (1.5, 0.0), kept_drafter=False)  # dormant as launched: none
    step(0, (1.5, 0.0), prefill=False)  # decode-only: none
    assert seen == [1.25, 0.0]
