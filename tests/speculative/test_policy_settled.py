"""Settled decisions to draft: where one K > 0 clearly beats every other K and plain
decoding, the goodput policy repeats it for SETTLED_STEPS steps without deliberating (on a
fast model the deliberation is a few percent of a host-paced step), and deliberates again
as soon as the batch's bucket, its prefill, a request's room to draft or the margin says
otherwise; requests coming and going within the bucket keep the hold."""

from __future__ import annotations

import pytest

from specserve.speculative.buckets import batch_bucket
from specserve.speculative.goodput_policy import GoodputPolicy
from specserve.speculative.mode_rates import ModeRates
from specserve.speculative.policy_base import StepLoad
from tests.speculative.test_policy import FakeRequest, _measured, _policy, _reqs

N = 8


class _Counted:
    """Counts the policy's deliberations: each reads every request's acceptance once."""

    def __init__(self, policy: GoodputPolicy):
        self.calls = 0
        inner = policy.acceptance.cumulatives

        def cumulatives(ids):
            self.calls += 1
            return inner(ids)

        policy.acceptance.cumulatives = cumulatives


def _settled_policy(alpha: float = 0.8):
    policy, _ = _policy(alpha=alpha, k_max=3)
    _measured(policy, N)
    return policy


@pytest.mark.parametrize("n", [1, N])
def test_a_clear_decision_to_draft_holds_without_deliberating(n):
    policy, _ = _policy(alpha=0.8, k_max=3)
    _measured(policy, n)
    counted = _Counted(policy)
    reqs = _reqs(n)
    assert policy.choose(reqs) == [3] * n and counted.calls == 1
    first = policy.trace.recent[-1]
    for _ in range(GoodputPolicy.SETTLED_STEPS - 1):
        assert policy.choose(reqs) == [3] * n
        held = policy.trace.recent[-1]
        assert held.tokens == first.tokens and held.period_ms == first.period_ms
        assert held.held and not first.held  # (the trace says which were deliberated)
        assert policy.predicted_tokens == first.tokens[3]
    assert counted.calls == 1  # (before: one deliberation a step)
    assert policy.trace.settled_steps == GoodputPolicy.SETTLED_STEPS - 1
    assert policy._settled is None
    policy.choose(reqs)
    assert counted.calls == 2  # the hold ran out: deliberated again


def test_a_held_decision_gives_way_to_what_changed():
    """A step carrying prefill, a request that cannot draft K, another batch bucket: each is
    deliberated (and ends the hold)."""
    changes = {
        "prefill": (_reqs(N), StepLoad(prefill_tokens=64)),
        "a request near its end": (
            _reqs(N - 1) + [FakeRequest(f"r{N - 1}", max_useful_drafts=1)],
            StepLoad(),
        ),
        "a smaller batch bucket": (_reqs(N // 2), StepLoad()),
    }
    for name, (reqs, load) in changes.items():
        policy = _settled_policy()
        counted = _Counted(policy)
        policy.choose(_reqs(N))
        assert policy._settled is not None, name
        policy.choose(reqs, load)
        assert counted.calls == 2, name
        if name != "a smaller batch bucket":  # (there the new bucket's decision may hold)
            assert policy._settled is None or policy._settled[0] == policy.SETTLED_STEPS - 1


def test_drafting_ahead_by_less_than_the_margin_after_the_modes_factors_deliberates():
    """Drafting's factor (delivered over expected, `ModeRates`) at 0.45 of plain decoding's:
    K=3 still wins (2.5x plain decoding in the model, 1.1x corrected) but by less than
    DRAFT_SETTLE_MARGIN: every step deliberates, so the mode check keeps watching it."""
    policy = _settled_policy()
    modes = policy.modes = ModeRates()
    for step in range(ModeRates.MIN_STEPS):
        modes.observe(batch_bucket(N), "plain", 1.0, 1.0, 1.0, 1.0, step)
        modes.observe(batch_bucket(N), "drafting", 0.45, 1.0, 1.0, 1.0, step)
    counted = _Counted(policy)
    for step in range(4):
        assert max(policy.choose(_reqs(N))) == 3
        assert counted.calls == step + 1
    assert policy._settled is None


def test_a_held_decision_outlives_requests_coming_and_going_within_its_bucket():
    """A request leaving, and one joining after its prefill step (a decode step of other
    requests at the same bucket), repeat the held K with the held expectations scaled to
    the batch: the closed loop at 8 requests replaces one every few steps, and deliberating
    after each change cost the host most of what holding saves."""
    policy = _settled_policy()
    counted = _Counted(policy)
    assert policy.choose(_reqs(N)) == [3] * N
    per_request = policy.predicted_tokens / N
    smaller = _reqs(N - 1)  # one left (the bucket of 7 is 8's)
    assert batch_bucket(N - 1) == batch_bucket(N)
    assert policy.choose(smaller) == [3] * (N - 1)
    assert policy.predicted_tokens == pytest.approx(per_request * (N - 1))
    assert policy.choose(smaller + [FakeRequest("new")]) == [3] * N
    assert counted.calls == 1 and policy.trace.settled_steps == 2


def _held_on_a_seed():
    """K=3 wins at bucket N on its seed period (measured only at batch 1 there), and holds."""
    policy, _ = _policy(alpha=0.8, k_max=3)
    for k in range(3):
        policy.cost.observe(N, k, policy.cost.seed_ms(N, k))
    policy.cost.observe(1, 3, policy.cost.seed_ms(1, 3))
    assert policy.cost.observations(N, 3) == 0
    assert policy.choose(_reqs(N)) == [3] * N and policy._settled is not None
    return policy, _Counted(policy)


def test_a_hold_decided_on_a_seed_period_ends_when_measured_too_long():
    """On a host-bound engine the seeds (device time alone) are far short of the real
    periods: a hold decided on one would draft SETTLED_STEPS steps where plain decoding is
    better. Its K's first measurement, too long to beat plain decoding by
    DRAFT_SETTLE_MARGIN, ends it; the next step deliberates on the measured period."""
    policy, counted = _held_on_a_seed()
    assert policy.choose(_reqs(N)) == [3] * N and counted.calls == 0  # not measured yet
    policy.cost.observe(N, 3, 3.0 * policy.cost.seed_ms(N, 3))
    assert policy.choose(_reqs(N)) != [3] * N
    assert counted.calls == 1


def test_a_hold_decided_on_a_seed_period_that_a_measurement_confirms_goes_on():
    policy, counted = _held_on_a_seed()
    policy.cost.observe(N, 3, 1.2 * policy.cost.seed_ms(N, 3))
    for _ in range(3):
        assert policy.choose(_reqs(N)) == [3] * N
    assert counted.calls == 0 and policy._settled[3]["max_ms"] is None  # (checked once)


@pytest.mark.parametrize("scale, holds", [(1.0, True), (10.0, False)])
def test_drafting_ahead_by_a_little_holds_where_a_deliberation_is_a_share_of_the_step(scale, holds):
    """K=3 leads plain decoding by 9% (under DRAFT_SETTLE_MARGIN) and every other K by
    more than AWAKE_SETTLE_MARGIN. On ~1.7 ms steps (a host-bound engine: one deliberation
    is ~3% of one) the decision holds; on ~17 ms steps (0.3%) every step deliberates."""
    policy, _ = _policy(alpha=0.5, k_max=3)  # tokens at K = 0..3: 1, 1.5, 1.75, 1.875
    periods = [1.0, 1.72, 1.72, 1.72]  # K=3: 1.875 / 1.72 = 1.09x plain decoding
    for _ in range(24):  # (the cells converge on them)
        for k, ms in enumerate(periods):
            policy.cost.observe(N, k, ms * scale)
    counted = _Counted(policy)
    for _ in range(4):
        assert policy.choose(_reqs(N)) == [3] * N
    assert counted.calls == (1 if holds else 4)


def test_a_held_decision_for_plain_decoding_reads_no_cap():
    """The scheduler sets every request's cap only where the next choice reads it
    (`reads_caps`): a held decision for plain decoding does not, unless a burst on an
    idle server ends the hold; a deliberation and a held decision to draft do."""
    policy, _ = _policy(alpha=0.1, k_max=3)  # drafting far behind: plain decoding settles
    n = 64
    _measured(policy, n)
    assert policy.reads_caps(StepLoad())
    policy.dormant, policy._plain_decisions = True, policy.DORMANT_AFTER
    assert policy.choose(_reqs(n)) == [0] * n
    assert policy._settled is not None and policy._settled[1] == 0
    assert not policy.reads_caps(StepLoad())
    assert policy.reads_caps(StepLoad(waiting=4, after_idle=True))  # (a burst deliberates)

    class Uncapped:  # a cap not set this step: reading it fails
        def __init__(self, request_id: str):
            self.request_id, self.drafter_backlog = request_id, 0

        @property
        def max_useful_drafts(self):
            raise AssertionError("read a cap the scheduler did not set")

    uncapped = [Uncapped(f"r{i}") for i in range(n)]
    while policy._settled is not None:  # the hold reads no cap to its end
        assert not policy.reads_caps(StepLoad())
        assert policy.choose(uncapped) == [0] * n
    assert policy.reads_caps(StepLoad())  # (then it deliberates)
    held = _settled_policy()
    held.choose(_reqs(N))
    assert held._settled is not None and held._settled[1] == 3
    assert held.reads_caps(StepLoad())
