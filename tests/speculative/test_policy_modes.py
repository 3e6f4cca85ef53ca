"""The goodput policy checks its model against what each mode delivered, all costs in
(`ModeRates`): each mode's factor is its delivered over its expected goodput, drafting's
measured over its whole stretches (switches, catch-ups, plain steps with the drafter kept
up), plain decoding's with the drafter dormant; where a decision's expected goodput of
drafting, times drafting's factor, falls short of plain decoding's times plain's, the
decision to draft is overruled, until a retrial measures drafting again; the other way
round, a decision for plain decoding is overruled. Steps carrying prefill count for neither
mode."""

from __future__ import annotations

import pytest

from specserve.core.batch import ScheduledRequest
from specserve.speculative.mode_rates import ModeRates
from specserve.speculative.speculator import Speculator
from specserve.speculative.step_periods import PeriodLog
from tests.speculative.test_policy import FakeRequest, _measured, _policy, _reqs

N = 16


TIE = (1.0, 1.0)  # a decision expecting drafting and plain decoding to deliver alike


def _rates(plain: float, drafting: float, steps: int = ModeRates.MIN_STEPS, at: int = 0):
    """ModeRates with `steps` steps of each mode at bucket 16 whose delivered goodput was
    `plain` and `drafting` times what their decisions expected (the factors), the last on
    policy step `at`."""
    modes = ModeRates()
    for i in range(steps):
        modes.observe(N, "plain", plain, 1.0, 1.0, 1.0, at - steps + i + 1)
        modes.observe(N, "drafting", drafting, 1.0, 1.0, 1.0, at - steps + i + 1)
    return modes


# a decision's expectations at K = 0..3: committed tokens (16 requests), periods (ms)
EXPECTED = dict(tokens=[N, 1.5 * N, 1.75 * N, 2 * N], period_ms=[1.0, 1.5, 1.75, 2.0])


def _speculator(policy, acceptance) -> Speculator:
    """The engine's Speculator around `policy`, without an engine (its observe_period)."""
    spec = Speculator.__new__(Speculator)
    spec.policy, spec.cost, spec.periods = policy, policy.cost, PeriodLog(policy.cost)
    spec.clear_step_history()
    spec.acceptance = acceptance
    return spec


def _factors(policy) -> dict:
    """The modes' factors and steps by "bucket:mode" (their snapshot), to 6 digits."""
    snapshot = policy.modes.snapshot()
    return {
        cell: (round(f, 6), snapshot["mode_steps"][cell])
        for cell, f in snapshot["mode_factor"].items()
    }


def test_drafting_is_held_back_only_where_it_lost_on_enough_steps():
    assert not _rates(1.0, 0.995).holds_back(N, 1, *TIE)  # within MARGIN
    assert _rates(1.0, 0.95).holds_back(N, 1, *TIE)
    assert not _rates(1.0, 0.95, steps=ModeRates.MIN_STEPS - 1).holds_back(N, 1, *TIE)
    assert not _rates(1.0, 0.95).holds_back(32, 1, *TIE)  # another bucket: not measured
    assert not _rates(0.95, 1.0).holds_back(N, 1, *TIE)
    # the decision's own expectations count: drafting expected 10% ahead survives a 5% loss
    assert not _rates(1.0, 0.95).holds_back(N, 1, 1.1, 1.0)
    assert _rates(1.0, 0.95).holds_back(N, 1, 1.03, 1.0)
    modes = _rates(1.0, 0.95)
    assert modes.rate(N, "plain") == 1.0 and modes.rate(N, "drafting") == 0.95
    assert modes.rate(32, "plain") is None


def test_plain_decoding_unmeasured_counts_as_expected_at_a_near_tie_of_many_requests():
    """A policy that always prefers drafting by a little never goes dormant, so plain
    decoding's factor is never measured: at a bucket of PRIOR_MIN_BATCH requests or more,
    where drafting's decision leads by under PRIOR_GAP and its own factor turns the lead
    into a loss, plain decoding is taken to deliver what it is expected to (its period is
    the drafter-awake K = 0 one, which dormancy only shortens): drafting is held back, so
    the policy goes dormant and plain decoding gets measured. Not at fewer requests, not
    for a larger lead, and never the other way round (overruling plain decoding)."""
    many, gap = ModeRates.PRIOR_MIN_BATCH, ModeRates.PRIOR_GAP

    def drafting_only(factor: float, bucket: int) -> ModeRates:
        modes = ModeRates()
        for i in range(ModeRates.MIN_STEPS):
            modes.observe(bucket, "drafting", factor, 1.0, 1.0, 1.0, i)
        return modes

    assert drafting_only(0.9, many).holds_back(many, 200, 1.02, 1.0)  # 0.918 < 1.0
    assert not drafting_only(0.99, many).holds_back(many, 200, 1.02, 1.0)  # 1.01 x 1.01
    assert not drafting_only(0.9, many // 2).holds_back(many // 2, 200, 1.02, 1.0)
    lead = 1.0 / (1.0 - gap) + 0.01  # drafting expected to lead by more than the gap
    assert not drafting_only(0.5, many).holds_back(many, 200, lead, 1.0)
    assert not drafting_only(0.9, many).favors_drafting(many, 200, 1.02, 1.0)
    # once plain decoding is measured, its own factor decides
    modes = drafting_only(0.9, many)
    for i in range(ModeRates.MIN_STEPS):
        modes.observe(many, "plain", 0.85, 1.0, 1.0, 1.0, 200 + i)
    assert not modes.holds_back(many, 400, 1.02, 1.0)  # 0.918 > 0.85 x 1.01


def test_factors_follow_the_expectations_not_the_requests_acceptance():
    """Drafting measured while hard requests ran (few tokens a step, as expected of them)
    delivered what was expected: it is not held back when an easy request's decision
    expects drafting to win, though its raw tokens per ms were below plain decoding's. On
    the H200 with the default model, one request at a time, raw rates held drafting back
    on 60-500 decisions a run where fixed K=3 delivered 1.09x plain decoding."""
    modes = ModeRates()
    for step in range(ModeRates.MIN_STEPS):
        modes.observe(N, "plain", 1.0, 1.0, 1.0, 1.0, step)  # 1 token a request in 1 ms
        modes.observe(N, "drafting", 1.2, 1.2, 2.0, 2.0, step)  # 0.6 tokens a ms, expected
    assert modes.rate(N, "drafting") == 1.0 and modes.rate(N, "plain") == 1.0
    assert not modes.holds_back(N, ModeRates.MIN_STEPS, 2.4 / 2.0, 1.0)  # an easy request
    assert modes.holds_back(N, ModeRates.MIN_STEPS, 1.2 / 2.0, 1.0)  # a hard one: as expected
    # what the expectations miss lowers the factor: periods 25% over, tokens 10% under
    modes = ModeRates()
    for step in range(ModeRates.MIN_STEPS):
        modes.observe(N, "drafting", 0.9 * 2.4, 2.4, 2.5, 2.0, step)
    assert modes.rate(N, "drafting") == pytest.approx(0.9 / 1.25)


def test_a_retrial_measures_drafting_again_and_a_lost_one_doubles_the_wait():
    retry = ModeRates.RETRY_STEPS
    modes = _rates(1.0, 0.9)  # drafting last ran on step 0
    assert modes.holds_back(N, retry - 1, *TIE) and modes.num_held == 1
    assert not modes.holds_back(N, retry, *TIE)  # a retrial: drafting's factor starts over ...
    assert modes.rate(N, "drafting") is None
    for step in range(retry, retry + ModeRates.MIN_STEPS):  # ... and is let through
        assert not modes.holds_back(N, step, *TIE)
        modes.observe(N, "drafting", 0.9, 1.0, 1.0, 1.0, step)  # it lost again
    last = retry + ModeRates.MIN_STEPS - 1
    assert modes.holds_back(N, last + 1, *TIE)
    assert modes.holds_back(N, last + 2 * retry - 1, *TIE)  # the next retrial: twice the wait
    assert not modes.holds_back(N, last + 2 * retry, *TIE)
    for step in range(last + 2 * retry, last + 2 * retry + ModeRates.MIN_STEPS):
        modes.observe(N, "drafting", 1.1, 1.0, 1.0, 1.0, step)  # it won: no more holding back
    assert not modes.holds_back(N, last + 2 * retry + ModeRates.MIN_STEPS, *TIE)
    assert modes._retry == {}  # and the waits start over the next time drafting loses


def test_steps_while_held_back_do_not_count_as_drafting():
    """Held back, the policy decodes plainly with the drafter still awake until it goes
    dormant: those steps are the holding's, not drafting's (they would pull drafting's
    rate towards plain decoding's); a decision that goes through counts again."""
    modes = _rates(1.0, 0.9)
    assert modes.holds_back(N, 1, *TIE)
    modes.observe(N, "drafting", 5.0, 1.0, 1.0, 1.0, 2)  # an awake plain step while held back
    assert modes.rate(N, "drafting") == 0.9
    assert not modes.holds_back(32, 2, *TIE)  # another bucket: not held
    modes.observe(32, "drafting", 5.0, 1.0, 1.0, 1.0, 2)
    assert modes.rate(32, "drafting") is None and modes._cells[(32, "drafting")].steps == 1
    modes = _rates(1.0, 1.1)
    assert not modes.holds_back(N, 1, *TIE)
    modes.observe(N, "drafting", 1.1, 1.0, 1.0, 1.0, 2)
    assert modes._cells[(N, "drafting")].steps == ModeRates.MIN_STEPS + 1


def test_the_policy_decodes_plainly_where_drafting_lost_and_settles_dormant():
    policy, _ = _policy(alpha=0.8, k_max=3)
    _measured(policy, N)
    assert max(policy.choose(_reqs(N))) == 3  # the model's choice: drafting pays
    policy.modes = _rates(1.0, 0.2, at=policy.num_steps)  # (its expected gain: under 5x)
    policy._settled = None  # (the decision above holds SETTLED_STEPS steps otherwise)
    decided = 0
    while not policy.dormant:  # (probes still measure the other Ks: they are not held)
        k = max(policy.choose(_reqs(N)))
        if not policy.trace.recent[-1].probe:
            assert k == 0
            decided += 1
    assert decided == policy.DORMANT_AFTER and policy.modes.num_held == decided
    # dormant and held back: the decision holds without deliberating (settled steps)
    assert policy.choose(_reqs(N)) == [0] * N and policy._settled is not None
    # where drafting won, the model decides again
    policy, _ = _policy(alpha=0.8, k_max=3)
    _measured(policy, N)
    policy.modes = _rates(1.0, 1.2, at=policy.num_steps)
    assert max(policy.choose(_reqs(N))) == 3 and policy.modes.num_held == 0


def test_each_step_counts_for_its_mode_probes_and_steps_without_decodes_for_none():
    """Through the speculator: a step's committed tokens per decoding request and its
    period, beside what its decision expected of them at the step's K, go to "plain" while
    the policy is dormant, else to "drafting" (plain steps with the drafter kept up
    included); probes, steps without decoding requests and decisions that expected nothing
    to neither."""
    policy, acceptance = _policy(alpha=0.8, k_max=3)
    spec = _speculator(policy, acceptance)
    clock = [1.0]

    def step(k, committed, dormant=False, probe=False, decodes=N):
        policy.dormant = dormant
        batch = []
        for _ in range(decodes):
            s = ScheduledRequest(None, 1, k, decoding=True)
            s.drafts = [0] * k
            batch.append(s)
        if not decodes:
            batch.append(ScheduledRequest(None, 16))
        policy._decided([k] * decodes, probe=probe, **EXPECTED)
        spec._last_committed = committed
        clock[0] += 0.002
        spec.observe_period(batch, clock[0], False)

    step(0, N)  # the first: no period
    step(3, 2 * N)  # drafting: 2 tokens per request in 2 ms
    step(0, N)  # a plain step with the drafter awake: drafting's too
    step(0, N, dormant=True)
    step(3, 2 * N, dormant=True, probe=True)  # a probe while dormant: neither
    step(0, 0, decodes=0)  # prefill only: neither
    # drafting: as expected (1), then an awake plain step in twice its expected period;
    # plain: a dormant step in twice its expected period
    assert _factors(policy) == {"16:drafting": (0.75, 2), "16:plain": (0.5, 1)}
    policy.dormant = False  # a decision that expected nothing: neither
    policy._decided([0] * N)
    spec._last_committed = N
    clock[0] += 0.002
    spec.observe_period(
        [ScheduledRequest(None, 1, 0, decoding=True) for _ in range(N)], clock[0], False
    )
    assert _factors(policy) == {"16:drafting": (0.75, 2), "16:plain": (0.5, 1)}
    policy.dormant = False  # a step carrying prefill beside its decodes: neither
    batch = [ScheduledRequest(None, 1, 0, decoding=True) for _ in range(N)]
    batch[0].drafts = []
    batch.append(ScheduledRequest(None, 16))
    policy._decided([0] * N, **EXPECTED)
    spec._last_committed = N
    clock[0] += 0.002
    spec.observe_period(batch, clock[0], False)
    assert _factors(policy) == {"16:drafting": (0.75, 2), "16:plain": (0.5, 1)}


def test_decode_steps_beside_a_step_carrying_prefill_count_for_neither_mode():
    """A decode-only step counts for its mode only between decode-only steps (decided with
    one step of hindsight, as the cost model's steady samples): beside a step carrying
    prefill its period holds part of that step's host work, which follows the load (on an
    H100 at 0.9 of plain decoding's peak, plain decoding's factor fell to 0.63 that way and
    drafting overruled it). Here the steps beside prefill take 3-4 times their expected
    period and the interior ones as expected: drafting's factor stays 1."""
    policy, acceptance = _policy(alpha=0.8, k_max=3)
    spec = _speculator(policy, acceptance)
    clock = [1.0]

    def step(ms, prefill=False):
        batch = []
        for _ in range(N):
            s = ScheduledRequest(None, 1, 3, decoding=True)
            s.drafts = [0] * 3
            batch.append(s)
        if prefill:
            batch.append(ScheduledRequest(None, 16))
        policy._decided([3] * N, **EXPECTED)
        spec._last_committed = 2 * N  # as expected: 2 tokens a request
        clock[0] += ms / 1e3
        spec.observe_period(batch, clock[0], False)

    step(2.0)  # the first: no period
    step(2.0)  # interior so far, but the next carries prefill: neither
    step(8.0, prefill=True)
    step(8.0)  # after prefill: neither
    step(2.0)
    step(2.0)
    step(6.0)  # before prefill: neither
    step(8.0, prefill=True)
    assert _factors(policy) == {"16:drafting": (1.0, 2)}


def test_plain_decoding_is_overruled_where_drafting_delivered_more():
    """The other way round: drafting measured above plain decoding by more than MARGIN
    (both over MIN_STEPS) overrules a decision for K=0 (to the K the model rates best
    among K > 0); plain decoding's rate gets retrials that double as drafting's do."""
    assert _rates(1.0, 1.05).favors_drafting(N, 1, *TIE)
    assert not _rates(1.0, 1.005).favors_drafting(N, 1, *TIE)  # within MARGIN
    assert not _rates(1.0, 1.05, steps=ModeRates.MIN_STEPS - 1).favors_drafting(N, 1, *TIE)
    assert not _rates(1.05, 1.0).favors_drafting(N, 1, *TIE)
    assert not _rates(1.0, 1.05).favors_drafting(N, 1, 0.9, 1.0)  # expected 10% behind
    retry = ModeRates.RETRY_STEPS
    modes = _rates(1.0, 1.1)  # plain decoding last ran on step 0
    assert modes.favors_drafting(N, retry - 1, *TIE) and modes.num_favored == 1
    assert not modes.favors_drafting(N, retry, *TIE)  # a retrial: plain's factor starts over
    assert modes.rate(N, "plain") is None and modes._plain_retry[N] == 2 * retry
    for step in range(retry, retry + ModeRates.MIN_STEPS):
        modes.observe(N, "plain", 1.2, 1.0, 1.0, 1.0, step)  # plain decoding won this time
    assert not modes.favors_drafting(N, retry + ModeRates.MIN_STEPS, *TIE)
    assert modes._plain_retry == {}

    policy, _ = _policy(alpha=0.05, k_max=3)  # the model's choice: plain decoding
    _measured(policy, N)
    while not policy.dormant:
        policy.choose(_reqs(N))
    policy.modes = _rates(1.0, 3.0, at=policy.num_steps)  # drafting delivered far more
    policy._settled = None
    k = max(policy.choose(_reqs(N)))
    assert k > 0 and policy.modes.num_favored == 1 and not policy.dormant
    assert policy.trace.wakes == {"favored": 1}  # a wake, by its cause


def test_a_dormant_drafter_is_not_favored_awake_past_its_catch_up():
    """Dormant, drafting's expected goodput carries the wake (the batch's catch-up, spread
    as in the ranking) before the mode check weighs it: a batch whose drafter has a long
    backlog is not woken by a 10% better delivered factor (the H200, 512 requests at
    acceptance 1.5: three such wakes, each catching up the whole batch)."""
    policy, _ = _policy(alpha=0.05, k_max=3)
    _measured(policy, N)
    while not policy.dormant:  # the model's choice: plain decoding
        policy.choose(_reqs(N))
    policy.modes = _rates(1.0, 1.1, at=policy.num_steps)
    behind = [FakeRequest(f"r{i}", drafter_backlog=100_000) for i in range(N)]
    assert max(policy.choose(behind)) == 0 and policy.modes.num_favored == 0
    policy._settled = None
    assert max(policy.choose(_reqs(N))) > 0  # nothing to catch up: favored, as before
    assert policy.trace.wakes == {"favored": 1}
