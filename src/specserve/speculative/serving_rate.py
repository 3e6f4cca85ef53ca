"""What the goodput policy weighs when a step carries more than decode rows: the server's
running tokens per ms (the price of a millisecond), the prefill that extra commits bring in
a loaded server, how long a K chosen beside prefill lasts, and what drafting adds there."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specserve.speculative.cost_model import StepCostModel


class ServingRate:
    """The server's committed tokens per ms over recent steps: EWMAs of each step's
    committed tokens and period, over every step (prefill-only and mixed ones included:
    they take time too). `ready` once MIN_STEPS steps were seen and something committed.

    `per_row` weighs each step by its decoding rows, over about a request's life
    (ROW_WEIGHT). Tokens that drafts add beside prefill come off the ends of their requests'
    lives, so what they save is steps where the requests decode, not the server's average
    step: in waves (requests sent together, of one length) a wave's prefill runs with few
    decode rows and drags the running rate to a third of what its decode steps make, and
    drafts priced at it (steps of prefill, K=1 at acceptance 1.5 on the 8B shape) cost more
    than they saved (serving simulator, lockstep). `price`, the price of a millisecond in a
    step carrying prefill, is that or `value`, whichever is higher."""

    WEIGHT = 1 / 64  # EWMA weight per step
    ROW_WEIGHT = 1 / 256  # about a request's life in steps (lockstep needs it: 1/192 woke)
    MIN_STEPS = 16

    def __init__(self) -> None:
        self.steps = 0
        self._tokens = self._ms = 0.0
        self._row_tokens = self._row_ms = 0.0

    def observe(self, committed: int, period_ms: float, rows: int = 0) -> None:
        """A step committed this many tokens in period_ms, with `rows` decoding requests."""
        self.steps += 1
        w = max(self.WEIGHT, 1.0 / self.steps)  # (a plain mean until the EWMA spans enough)
        self._tokens += w * (committed - self._tokens)
        self._ms += w * (period_ms - self._ms)
        w = max(self.ROW_WEIGHT, 1.0 / self.steps)
        self._row_tokens += w * (rows * committed - self._row_tokens)
        self._row_ms += w * (rows * period_ms - self._row_ms)

    @property
    def value(self) -> float:
        """Tokens per ms (0 before any step)."""
        return self._tokens / self._ms if self._ms > 0 else 0.0

    @property
    def per_row(self) -> float:
        """Tokens per ms weighted by the steps' decoding rows (`value` until a step had
        any)."""
        return self._row_tokens / self._row_ms if self._row_ms > 0 else self.value

    @property
    def price(self) -> float:
        """What a millisecond of a step carrying prefill is worth, in tokens: `per_row` or
        `value`, whichever is higher. The two follow a change of the server's rate at
        different speeds (`value` over about 64 steps, `per_row` over a request's life):
        taking the higher, a ms is priced at the faster one while the rate climbs (after a
        start, an idle or a change of load) and at the slower one while it falls, so drafts
        beside prefill are priced high while the rate moves, never low. By rows alone, at
        256 clients, L = 3.0, with a 12 ms surcharge (serving simulator), the price climbed
        from 6 to 10.4 tokens per ms over a run while goodput drafted in prefill steps
        (plain decoding makes 10.7): 0.984 of plain decoding over 12 seeds, 1.036 with the
        higher of the two (the same floor over `per_row`'s horizon: 0.984). In waves
        (`per_row`'s case) `value` stays below it."""
        return max(self.per_row, self.value)

    def snapshot(self) -> dict:
        return {"prefill_price_tokens_per_s": self.price * 1e3}

    @property
    def ready(self) -> bool:
        return self.steps >= self.MIN_STEPS and self.value > 0


def queued_prefill_ms(
    target: Callable[[float], float],
    n: int,
    tokens: list[float],
    extra_tokens: int,
    per_token: float,
) -> list[float]:
    """What each K's commits bring in prefill, priced on the target's curve at the step's
    size: a loaded server prefills `per_token` prompt tokens for every token it generates (a
    request finished admits the next), so a step committing t tokens brings per_token x t
    prompt tokens into the steps after it, whatever K was. Whole tokens (the curve memoizes
    by size)."""
    out = []
    for k, t in enumerate(tokens):
        size = n * (k + 1) + extra_tokens
        more = round(per_token * t)
        out.append(target(size + more) - target(size) if more > 0 else 0.0)
    return out


def marginal_k(
    tokens: list[float], costs: list[float], switch: list[float], rate: float, dwell: list[float]
) -> int:
    """The K whose tokens beyond their cost at the server's running rate are the most
    (tokens - rate x ms), a switch there and back spread over `dwell[K]` steps (how long K
    would last: `prefill_dwell`). For a step that carries prefill, the step's
    own tokens per ms would rank K wrong: its prefill costs the same at every K, so the ratio
    spreads that cost over more tokens at a larger K and drafts where the extra verify rows,
    at the full GEMM slope once prefill fills the step, earn less than the server earns on
    average."""
    scores = [t - rate * (ms + sw / d) for t, ms, sw, d in zip(tokens, costs, switch, dwell)]
    return scores.index(max(scores))  # the first of equals: the fewer drafts


class PrefillRuns:
    """How long a K chosen for a step carrying prefill lasts where the decode-only steps
    would not keep it (`prefill_dwell`): the mean length of the runs of
    consecutive decisions that carry prefill (an EWMA over about 1/WEIGHT runs; 1 before one
    ended), or the current run's length where that is longer, at least 1. And how many
    decisions carry prefill (`share`, `per_decode_step`: what the drafter's upkeep beside
    prefill costs drafting on decode-only steps, `DrafterUpkeep`)."""

    WEIGHT = 1 / 16
    SHARE_WEIGHT = 1 / 256  # `share`: over about a request's life
    MAX_SHARE = 0.9  # (`per_decode_step` at most 9)

    def __init__(self) -> None:
        self.mean = 1.0
        self.runs = 0  # runs ended
        self.current = 0  # decisions carrying prefill in a row, up to the latest
        self.share = 0.0  # of the decisions, those carrying prefill (an EWMA)
        self._decisions = 0

    @property
    def per_decode_step(self) -> float:
        """Decisions carrying prefill for each decode-only one, from `share`."""
        share = min(self.share, self.MAX_SHARE)
        return share / (1.0 - share)

    def observe(self, carries_prefill: bool) -> None:
        """One decision (a step with decoding requests), carrying prefill or not."""
        self._decisions += 1
        w = max(self.SHARE_WEIGHT, 1.0 / self._decisions)
        self.share += w * (carries_prefill - self.share)
        if carries_prefill:
            self.current += 1
        elif self.current:
            self.runs += 1
            w = max(self.WEIGHT, 1.0 / self.runs)
            self.mean += w * (self.current - self.mean)
            self.current = 0

    def dwell(self, cap: int) -> float:
        """Steps over which a switch for the current step carrying prefill is spread."""
        return min(float(cap), max(1.0, self.mean, float(self.current)))


def prefill_dwell(
    cost: StepCostModel,
    runs: PrefillRuns,
    tokens: list[float],
    n: int,
    context: int,
    cap: int,
    margin: float,
) -> list[float]:
    """For a step carrying prefill of `n` decoding requests, the steps over which a switch to
    each K = 0..len(tokens)-1 is spread (`marginal_k`): `cap` (a decode K's dwell) where a
    decode-only step of this batch would keep that K (no other K beats it by `margin` at the
    cost model's decode periods, expected `tokens` each), else only the run of steps
    carrying prefill it leads (`runs`): the decode step after them switches back. Only
    where switches to and from plain decoding were measured at the batch's bucket
    (`StepCostModel.switch_measured`): a prior charged in full (half a plain step each
    way) kept steps carrying prefill at the decode steps' K where plain decoding beside
    prefill was better (serving simulator, 256 clients at 0.9 of the peak, L = 1.5: 0.977 of
    the best, 1.024 before). (Spread over `cap` everywhere, at 64 clients of the default
    model on an H100 what drafting costs beside prefill made each such step leave drafting
    for one step and come back: 3,417 switches in 3,877 steps, each way back the drafter's
    catch-up of 3-7 ms at that batch.)"""
    if not cost.switch_measured(n):
        return [float(cap)] * len(tokens)
    periods, _, _ = cost.period_table(n, len(tokens) - 1, 0, context)
    rates = [t / ms for t, ms in zip(tokens, periods)]
    short = runs.dwell(cap)
    out = []
    for k, rate in enumerate(rates):
        g = rate * (1.0 + margin)
        kept = all(r <= g for j, r in enumerate(rates) if j != k)
        out.append(float(cap) if kept else short)
    return out


class DraftingSurcharge:
    """What drafting adds to a step that carries prefill beyond what the step cost model
    predicts, measured: EWMAs of each such step's period minus the
    model's prediction for it as decided, apart for plain steps (K = 0) and drafting ones
    (K > 0). The surcharge is the second over the first (never below 0), once drafting's
    was seen MIN_STEPS times (0 before; plain decoding's residual counts as 0 until
    measured, so a surcharge that was the model's error for every prefill step shows as
    drafting's until plain prefill steps, which it brings about, measure it).

    The cost model prices steps from start-up timings of padded decode steps; a step
    carrying prefill runs eagerly, and drafting there adds what those timings never saw (the
    drafter's eager passes over the decode rows and the prompt, their host launches). On an
    H100 (Llama-3.1-8B shape, acceptance 1.5, Poisson arrivals), a prefill step at K=1 took
    about 6 ms more than a plain one in one process, and about 11 ms through the server;
    fixed K=1 fell below plain decoding, and goodput, ranking K in such steps by the model
    alone, to 0.62-0.77 of the best (docs/performance.md, session 49).

    `due(step_ms)`: a deliberation of a step carrying prefill that leaves the surcharge out
    of the ranking, so that drafting there is measured again where only the surcharge keeps
    it off (where the model alone would not draft either, nothing is lost by not measuring
    it): one in as many as keep such probes within PROBE_BUDGET of those steps' time (each
    costs about the surcharge), MIN_EVERY to MAX_EVERY; a new surcharge (none probed since
    it was last 0) sooner: MIN_EVERY, then twice as far each probe up to that. In the
    serving simulator with a 12 ms surcharge at 256 clients, L = 3.0 (nearly every step
    carrying prefill), probing every 16th step held goodput at 0.980 of plain decoding.
    Each residual weighs an observation WEIGHT for every deliberation of a step carrying
    prefill since its kind was last observed (at least one, at most replacing it), so
    both follow the same stretch of time whichever kind is rare (drafting's once priced,
    plain decoding's where drafting wins), and a probe stands for the steps it was not
    measured in: what every prefill step costs beyond the model moves both alike, and a
    transient is forgotten at the first probe. Weighed apart (plain 1/32, drafting 1/8), a
    slow swing of that common cost showed in drafting's residual first, as a surcharge: in
    the serving simulator at L = 3.0, 0.25 of the peak (fixed K=3 best everywhere) goodput
    fell to 0.967 of it, 0.986 weighed alike. Weighed 1/8 an observation and probed every
    256th step, a point's first slow drafting steps beside prefill (the default model
    through the server on an H100, session 60: 7.4 ms on the device against 2.6 for a
    decode-only step) left a 3 ms surcharge for the whole point, every step carrying
    prefill plain (648 of 654); in the serving simulator (five such steps 8 ms dearer, 8
    clients) 0.811 of the best against 0.978 without them, 0.962 now.

    The observations (`Speculator._observe_surcharge`) are the steps carrying prefill
    that ran the K decided, by their periods (what the policy ranks K by; plain steps
    between drafting ones included): drafting ones only after a drafting step (after a
    plain one the period holds the rows' catch-up, a switch's cost), plain ones only with
    the drafter kept up (a dormant step skips upkeep that drafting needs, which the wake
    prices), none after an idle engine or a wait. By device spans (sessions 50-59) a
    host-bound engine's surcharge was what drafting adds on the device, not to the period:
    the default model through the server on an H100 at 32 and 64 clients, plain prefill
    steps overran the model by 2.8-2.9 ms of period and -0.3-0.1 of span, drafting ones by
    1.4 and 0.7, so a surcharge of 0.4-3.7 ms (none by periods) kept 14-99% of its prefill
    steps plain for nothing (goodput 0.82-0.91 of fixed K=3 over three rounds). Under
    overlap a step's launch lies in the period of the step before it, which this does not
    read: in the traces of sessions 60 and 61 the decode step before a drafting one
    carrying prefill took 4.4-6.6 ms against 1.5-3.5 steady (before a plain one kept up
    4.5-6.2, dormant 2.4-2.5 against 1.8), the step itself no more than a decode step.
    Adding that excess to the step's own period (session 62) added its noise where
    drafting costs nothing more there: in the serving simulator with the overlap loop's
    timing, the default model's clock at 16 clients fell from 0.974 to 0.941 of the best
    over eight seeds; not kept. One surcharge for every K and batch size (the drafter's
    eager passes grow with K: a K measured at 1 underprices 3), on padded engines only
    (eager ones price every draft: `trim_drafts`)."""

    WEIGHT = 1 / 8
    MIN_STEPS = 4
    PROBE_BUDGET = 0.005
    MIN_EVERY, MAX_EVERY = 16, 256

    def __init__(self) -> None:
        self._residual = [0.0, 0.0]  # ms: plain, drafting
        self._steps = [0, 0]
        self._gap = [0, 0]  # deliberations of steps carrying prefill since each was observed
        self._since = 0  # deliberations of steps carrying prefill since the last probe
        self._probes = 0  # probes since the surcharge was last 0

    def observe(self, drafted: bool, period_ms: float, predicted_ms: float) -> None:
        """A step carrying prefill took period_ms where the model predicted predicted_ms."""
        i = int(drafted)
        self._steps[i] += 1
        gap, self._gap[i] = max(1, self._gap[i]), 0
        w = max(min(1.0, gap * self.WEIGHT), 1.0 / self._steps[i])
        self._residual[i] += w * (period_ms - predicted_ms - self._residual[i])
        if self.ms <= 0:
            self._probes = 0

    @property
    def ms(self) -> float:
        """Drafting's extra period in a step carrying prefill (0 until measured)."""
        if self._steps[1] < self.MIN_STEPS:
            return 0.0
        return max(0.0, self._residual[1] - self._residual[0])

    def every(self, step_ms: float) -> int:
        """How many deliberations of steps carrying prefill (of about step_ms) per probe."""
        surcharge = self.ms
        if surcharge <= 0 or step_ms <= 0:
            return self.MIN_EVERY
        budget = round(surcharge / (self.PROBE_BUDGET * step_ms))
        young = self.MIN_EVERY << min(self._probes, 16)
        return min(self.MAX_EVERY, max(self.MIN_EVERY, min(budget, young)))

    def due(self, step_ms: float) -> bool:
        """A deliberation of a step carrying prefill (its plain period about step_ms):
        whether this one leaves the surcharge out (a probe of drafting there)."""
        self._since += 1
        self._gap[0] += 1
        self._gap[1] += 1
        if self._since < self.every(step_ms):
            return False
        self._since = 0
        if self.ms > 0:
            self._probes += 1
        return True

    def snapshot(self) -> dict:
        return {"prefill_surcharge_ms": self.ms}


class DrafterUpkeep:
    """What keeping the drafter up costs a step carrying prefill, which plain decoding with
    the drafter dormant skips: the host time of the drafter's passes over the step's new
    prompt pairs (and, in a plain step, over the tokens decoded without drafts: its
    ride-alongs), as the step loop measures them, less what the host then waited for the
    step's tokens (a host that waits for the device had that time to spare: on a
    device-bound engine the passes' launches cost the period nothing). An EWMA over about
    1/WEIGHT such steps with the drafter kept up; `ms` is 0 until MIN_STEPS were seen.
    Approximations: a host that waited at all had all of it to spare, but a resolve waits
    0.02-0.03 ms even where the host paces the steps (the H100s of session 61), so the
    wait is subtracted rather than read as all or nothing, which overcharges an engine
    near balance by up to the upkeep less the wait; under overlap the wait is the step's
    own (after the next launch), not the one right after the passes. Not measured while
    dormant: the last figure stands until the drafter is kept up again.

    The modes' factors leave steps carrying prefill out and the cost model prices steady
    decode steps, so neither sees it; where drafting ties plain decoding on decode-only
    steps it decides between them. The default model through the server on an H100
    (session 60, machine B, 64 clients): every K within 1% on decode-only steps, while a
    plain step carrying prefill took 3.4-4.2 ms with the drafter kept up against 1.9
    dormant (a third of the steps carried prefill); goodput, awake for long stretches,
    delivered 0.875 of plain decoding. Measured so (session 61, another H100): 1.9 ms at 64
    clients (1.5 ms of host a drafting step carrying prefill, 2.2 a plain one; the host's
    wait 0.02-0.03), and goodput ran plain on 75-100% of its steps there. The passes'
    device time is not measured here (on a device-bound engine, a few percent of the
    target's prefill work): it goes unpriced, as before."""

    WEIGHT = 1 / 16
    MIN_STEPS = 4

    def __init__(self) -> None:
        self._ms = 0.0
        self.steps = 0

    def observe(self, ms: float) -> None:
        """A step carrying prefill with the drafter kept up spent `ms` of the host's time
        on the drafter's upkeep that it did not have to spare."""
        self.steps += 1
        w = max(self.WEIGHT, 1.0 / self.steps)
        self._ms += w * (ms - self._ms)

    @property
    def ms(self) -> float:
        """The upkeep a step carrying prefill (0 until measured)."""
        return self._ms if self.steps >= self.MIN_STEPS else 0.0

    def snapshot(self) -> dict:
        return {"prefill_upkeep_ms": self.ms}
