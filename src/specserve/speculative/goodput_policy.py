"""The goodput speculation policy: one draft length per step, the one with the most
expected committed tokens per millisecond under the measured step cost model and the
per-request acceptance estimates, with switches of K paid for and probes that keep every K's
cost and acceptance known."""

from __future__ import annotations

import math
from operator import attrgetter

from specserve.speculative.acceptance import AcceptanceModel
from specserve.speculative.buckets import batch_bucket
from specserve.speculative.cost_model import StepCostModel
from specserve.speculative.mode_rates import ModeRates
from specserve.speculative.policy_base import NO_LOAD, SpeculationPolicy, StepLoad
from specserve.speculative.policy_trim import trim_drafts
from specserve.speculative.serving_rate import (
    DrafterUpkeep,
    DraftingSurcharge,
    PrefillRuns,
    ServingRate,
    marginal_k,
    prefill_dwell,
    queued_prefill_ms,
)
from specserve.speculative.switch_costs import there_and_back_row

_request_id = attrgetter("request_id")
_max_useful_drafts = attrgetter("max_useful_drafts")
_unseen = attrgetter("drafter_backlog")  # tokens a request's drafter has yet to catch up on
_context = attrgetter("cached_len")  # tokens of a request's KV


class GoodputPolicy(SpeculationPolicy):
    """One draft length K per step, the one with the most expected committed tokens per
    millisecond: sum_r E_r[tokens | min(K, cap_r) drafts] / period(batch, K).

    Why one K per step: verify steps are padded to the longest draft (one CUDA graph per
    tokens per request) and the drafter's fastest path is a uniform chain, so a step with
    mixed draft lengths costs what its longest one costs; shorter drafts for some requests
    only lose their expected tokens. Periods are whole-step wall-clock times from the cost
    model's online table (host work, padding and overlap included), so a K whose steps cost
    more than their tokens repay is dropped. Where verify steps are never padded (no CUDA
    graphs), drafts whose expected gain does not pay for their share of the target's time
    are trimmed per request (lowest gain first, for every candidate K), and a trimmed request
    drafts fully once every REQUEST_PROBE_EVERY steps so that its estimate stays fresh.

    Switching K is not free (from plain decoding: a host wait that overlap would have hidden
    and the drafter's catch-up; back to plain: a step the loop cannot overlap): the cost
    model measures it per batch bucket and direction from the steps around each switch
    (`PeriodLog`). On a step of a millisecond it is worth several steps. So the policy
    leaves the K in use (the last step's unless that was a probe, else the bucket's
    preferred K) only for a K better by more than HYSTERESIS (or NOISE_Z standard errors of
    the two period estimates, unless that K takes no longer for no fewer tokens) once a
    switch there and back is spread over DWELL_STEPS steps, and probes pay their switches.

    Probing keeps every K's cost and acceptance known: a K not preferred runs for a few
    consecutive steps (the switch, enough steady ones to span PROBE_MS, at most
    PROBE_MAX_STEADY, and the one before the switch back, which carries part of it) once it
    has not run for an interval, counted in steps at the batch bucket, set so that probing
    it costs about PROBE_BUDGET of throughput under the model, switches included
    (ACCEPT_PROBE_BUDGET for K_max while plain decoding is preferred and drafting within
    FRESH_GAP: it also tells whether the requests' acceptance recovered): at least
    PROBE_EVERY probes' lengths, at most PROBE_MAX_INTERVAL steps unless that would cost more
    than PROBE_MAX_BUDGET; sooner while it has fewer than FRESH_OBSERVATIONS measurements
    and is close to the best or was just found far off, or its last observation was far off
    (doubtful), and after PROBE_EVERY steps of plain decoding when no request of the batch
    has drafted yet (their acceptance is only the global estimate). A K never measured at
    any batch size is measured at once. A K > 0 whose expected gain is under PROBE_MIN_GAIN
    tokens per request is not probed.

    Dormancy: keeping the drafter ready costs even while it does not draft (an EAGLE-3 head
    takes every prompt token and every plain-decoded token, a few percent of the target's
    work on the 8B shape). After DORMANT_AFTER decisions in a row for K=0 (probes aside)
    the policy is `dormant`: the engine stops that upkeep, and every K > 0 is priced with
    the catch-up it would cost (the batch's unseen tokens at the drafter's per-token cost,
    on top of the switch) until a decision for K > 0 wakes it. What that upkeep costs beside
    prefill, where the host pays for it (`DrafterUpkeep`), is charged to every K > 0: on a
    decode-only step for each step carrying prefill there is to one, on a step carrying
    prefill where drafting would keep the drafter from sleeping (in the serving simulator
    on machine B's clock at 64 clients, where every K ties on decode-only steps, 0.899 of
    plain decoding before, 0.996 charged). A probe drafts without
    waking it, on the DORMANT_PROBE_ROWS requests with the least to catch up (its catch-up
    is the probe's own switch cost; with more requests than that, only K_max is probed,
    priced by those rows' tokens, within DORMANT_PROBE_BUDGET). While dormant, a decision
    for K=0 that every K > 0 misses by SETTLE_MARGIN (before switch costs) holds
    SETTLED_STEPS steps without deliberating: on a fast model the deliberation itself would
    cost a tenth of a step. From SETTLE_MIN_BATCH requests it holds before dormancy too
    (a deliberation's cost grows with the batch: in the closed-loop simulator with the
    H200 host's deliberations charged, holding there took the host-bound engine at 64
    requests from 0.915 to 0.950 of plain decoding, and the default model's from 0.932 to
    0.942; at fewer requests a held K=0 kept answers that turned easy from drafting, down
    to 0.915 of the best at batch 1). There a K > 0 need miss only by SETTLE_MARGIN_MANY:
    where drafting comes within 10% of plain decoding at 64 requests of the default model
    (H100, chat prompts: 4% apart), every step deliberated, ~0.13 ms of a ~1.5 ms plain step
    for a choice that holding decides the same way, and a near K > 0 costs a held step at
    most its 5% (serving simulator on that engine's clock, tests/support/serving_clock.py:
    0.935 of plain decoding at 64, now 1.003; the policy simulator's default-model engine
    at 64 without a hard opening 0.934, now 0.963). So does a decision for K > 0 that every
    other K misses by AWAKE_SETTLE_MARGIN and plain decoding by DRAFT_SETTLE_MARGIN (after
    the modes' factors), at any batch size, while the batch stays in its bucket (requests may come
    and go), carries no prefill and every request may still draft K; one decided on K's
    seed period (not measured at the bucket) lasts only until a measurement confirms it.
    Where a deliberation (the H200 host's ~0.03 ms + 0.0015 a request) is FAST_STEP_SHARE
    of K's period or more, plain decoding need miss by DRAFT_SETTLE_MARGIN_FAST only: on
    the default model's clock at 8 and 16 requests fixed K=3 leads plain decoding by 12% and
    5%, so every step deliberated, ~3% of a ~1.4-1.9 ms step (serving simulator: 0.972 and
    0.954 of fixed K=3; 0.979 and 0.970 holding). Not on slower steps: with 1% the 8B
    shape's steps at ~200 requests qualified, and holding through its noise lost (the noisy
    Poisson case at 0.9 of the peak: 0.899 of the best).

    In a step carrying prefill, what drafting adds beyond the cost model (the step runs
    eagerly: the drafter's passes and launches there are not in start-up's padded timings)
    is measured and priced into the ranking (`DraftingSurcharge`): on an H100 at 18
    requests/s, L = 1.5, about 6 ms a step in one process and 11 through the server, where
    ranking by the model alone put goodput at 0.62-0.77 of the best under Poisson arrivals;
    in the serving simulator with such a surcharge, 0.76 and 0.63 of plain decoding before,
    1.21 and 1.11 of the best priced. The holds and the modes' checks compare the model's
    periods without it: a prefill step it alone made plain started holds of plain decoding
    over the decode-only steps after it (0.973 of plain decoding at 0.9 of its peak).

    A burst on an idle server (requests left waiting for admission at the first decision
    since nothing ran: a `bench sweep` point's first wave, a restart under load) puts it
    dormant where steps are padded (CUDA graphs; an eager engine's dormant probes are
    priced as if every row drafted, and rarely come due), so the drafter does not take the
    wave's prompts before drafting is known to pay. While
    dormant, a decision for K > 0 does not wake it while requests wait for admission (the
    batch's catch-up would come before their prefill), nor, at more than DORMANT_PROBE_ROWS
    requests, before WAKE_EVIDENCE drafts have been verified (the prior acceptance alone
    would catch up a whole batch): a decode-only step probes K on a few rows instead, a
    step carrying prefill runs plain. In the serving simulator from a cold start at 256 and
    512 requests, acceptance 1.5, starting awake gave 0.984 and 0.989 of plain decoding
    (the drafter took the first wave's prompts, then the prior woke it at the wave's end
    and it caught up the whole batch) and this 0.996 and 0.994. Under spread-out load a
    single probe's evidence woke it on a step carrying prefill at 256 requests, where plain
    decoding is best (0.976), and barring such steps from waking it woke it late at 128,
    where fixed K=1 is best (0.968 of the best); waiting for WAKE_EVIDENCE drafts: 0.996
    and 0.994 (0.987 at 128 before).
    """

    HYSTERESIS = 0.03
    NOISE_Z = 1.0
    DWELL_STEPS = 32  # a switch's one-off cost is spread over this many steps at the new K
    PROBE_MS = 3.0  # a probe spans at least this much steady time (short periods are noisy)
    PROBE_MAX_STEADY = 3
    PROBE_EVERY = 16  # probes of one K take at most 1/PROBE_EVERY of the steps
    PROBE_BUDGET = 0.005  # the share of throughput probing one K may cost
    ACCEPT_PROBE_BUDGET = 0.015  # probing K_max from plain decoding, when within reach
    PROBE_MAX_INTERVAL = 512  # bounds how long a wrong estimate can hide a good K ...
    PROBE_MAX_BUDGET = 0.01  # ... unless its probes would cost more than this share
    FRESH_OBSERVATIONS = 2  # a K measured fewer times, and within FRESH_GAP of the best
    FRESH_GAP = 0.3  # or just found far from its estimate, is probed again within
    # PROBE_EVERY << count steps (the cost model counts a surprised cell as measured once)
    UNSEEN_GAP = 0.5  # a K never measured at any batch size within this gap: measured at once
    UNSEEN_RETRY = 8  # steps before a probe that brought no observation is retried (x2 each)
    PROBE_MIN_GAIN = 0.1
    REQUEST_PROBE_EVERY = 32
    PROBE_MIN_ALPHA = 0.1
    DORMANT_AFTER = 64
    DORMANT_PROBE_ROWS = 16  # requests a probe drafts on while dormant
    DORMANT_PROBE_BUDGET = 0.004  # the share of throughput probing may cost while dormant
    WAKE_EVIDENCE = 64  # drafts verified before a dormant drafter wakes for many requests
    WAKE_STEPS = 256
    # The charge for the prefill a step's commits bring counts in full from this share of the
    # server's room up (`StepLoad.occupancy`), in proportion below it. Under Poisson arrivals
    # a request finished does not admit the next, and the full charge kept drafts short
    # beside prefill where a long draft was best (serving simulator, 0.9 of plain decoding's
    # peak: L = 4.5 0.959 of fixed K=5, now 0.986; L = 3.0 with the H100's attention 0.978,
    # now 0.987; the H100 through the server: 0.926 at L = 4.5). In proportion from 0 (no
    # knee) the population near plain decoding's peak (~130 of 256) lost what the charge
    # gives there: L = 1.5 at 0.9x fell from 1.024 of fixed K=1 to 0.987, with noisy steps
    # from 0.997 to 0.964 over 12 seeds; with the knee at half the room 1.024 and 0.993.
    FULL_CHARGE_OCCUPANCY = 0.5
    # While dormant (or from SETTLE_MIN_BATCH requests), a decision for plain decoding holds
    # this many steps (see `_settled`)
    SETTLED_STEPS = 16
    SETTLE_MIN_BATCH = 32  # a clear K=0 holds before dormancy too, from this many requests
    SETTLE_MARGIN = 0.1
    SETTLE_MARGIN_MANY = 0.05  # ... from SETTLE_MIN_BATCH requests (see the class)
    AWAKE_SETTLE_MARGIN = 0.05
    DRAFT_SETTLE_MARGIN = 0.2
    # ... where the host's deliberation (about DELIBERATION_MS plus DELIBERATION_MS_PER_REQ
    # a request) is FAST_STEP_SHARE of K's period or more
    DRAFT_SETTLE_MARGIN_FAST = 0.05
    DELIBERATION_MS, DELIBERATION_MS_PER_REQ = 0.03, 0.0015
    FAST_STEP_SHARE = 0.02

    def __init__(self, k_max: int, cost: StepCostModel, acceptance: AcceptanceModel):
        super().__init__(k_max)
        self.cost = cost
        self.acceptance = acceptance
        self.num_steps = 0
        self._preferred: dict[int, int] = {}  # batch bucket -> K in use
        self._bucket_steps: dict[int, int] = {}  # batch bucket -> steps taken at it
        self._last_run: dict[tuple[int, int], int] = {}  # (bucket, K) -> its step count then
        self._unseen_tries: dict[tuple[int, int], int] = {}
        self._probe: tuple[int, int, int] | None = None  # (bucket, K, steps left)
        self._idle: dict[str, int] = {}  # steps each request was trimmed (unpadded)
        self._running_k: int | None = None  # the last step's K unless it was a probe
        self.rate = ServingRate()  # the server's tokens per ms: prices steps with prefill
        self.prefill_runs = PrefillRuns()  # how long a K chosen beside prefill lasts
        self.modes = ModeRates()  # what plain decoding and drafting delivered, all costs in
        # what drafting adds to a step carrying prefill beyond the model: priced in its rank
        self.surcharge = DraftingSurcharge()
        # what keeping the drafter up costs a step carrying prefill: priced against dormancy
        self.upkeep = DrafterUpkeep()
        self.dormant = False  # the drafter's upkeep is stopped (see the class docstring)
        self._plain_decisions = 0  # decisions for K=0 in a row (probes aside)
        # (steps left, period ms, expectations): a dormant decision for K=0 that every
        # K > 0 missed by SETTLE_MARGIN, which the next steps repeat without deliberating,
        # whatever their batch or prefill. Deliberating costs the host ~60 us at 16 requests
        # and ~150 at 64 (the acceptance of every request, sums, the cost table, the probe
        # schedule): on a fast model, where plain decoding wins and a step takes ~1 ms,
        # 10-15% of the throughput. A change of load or a due probe is acted on at most
        # SETTLED_STEPS - 1 steps late (probe intervals: 48 steps and more).
        # Drafting likewise: a decision for K > 0 (decode-only, every request drafting K,
        # padded steps) that beats every other K by AWAKE_SETTLE_MARGIN holds SETTLED_STEPS
        # steps at its batch bucket while every request may draft K: on the default model
        # the policy's host work (~50 us a step at 8 requests, decision and bookkeeping)
        # was 3-4% of its ~1.5 ms speculative steps, which the host paces, and at one
        # request 4-5% of its ~1.1 ms ones (H200, session 34). At batch 1 a held K misses
        # some of one request's moving acceptance: in the closed-loop simulations (16
        # seeds, no host time charged) 0.3-0.4% of the best fixed K in two engines and a
        # 0.4% gain in the third, against the ~6 us (CI-class CPU) to ~40 us (H200 host)
        # a step that deliberating costs there.
        # (steps left, K, period ms, expectations)
        self._settled: tuple[int, int, float, dict] | None = None

    def reads_caps(self, load: StepLoad) -> bool:
        """Not for a held decision for plain decoding (`_settled` with K = 0), which reads
        no request's cap (unless a burst ends it: see `choose`)."""
        settled = self._settled
        if settled is None or settled[1]:
            return True
        return bool(load.after_idle and load.waiting and self.cost.padded)

    def choose(self, reqs, load: StepLoad = NO_LOAD):
        n = len(reqs)
        if n == 0:
            self._running_k = None
            return self._decided([])
        self.num_steps += 1
        if load.after_idle and load.waiting and self.cost.padded:  # a burst: see the class
            self.dormant, self._plain_decisions = True, self.DORMANT_AFTER
            self._settled = self._probe = self._running_k = None  # (from before the idle)
        k_max = self.k_max
        extra_tokens = load.prefill_tokens
        self.prefill_runs.observe(extra_tokens > 0)
        k_budget = load.k_cap(n, k_max)  # the step's budget left for drafts
        self.acceptance.tick()
        if k_budget == 0:  # prefill took the budget: no choice to make, nothing learned
            self.predicted_tokens, self.predicted_ms = float(n), 0.0
            return self._decided([0] * n)
        settled = self._settled
        if settled is not None:
            left, k, ms, expected = settled
            bucket = batch_bucket(n)
            # A held K > 0 holds only for decode steps at its bucket whose requests may all
            # draft K, whichever requests they are (one leaving or, after its prefill step,
            # one joining moves the expected tokens by its share only; in the closed-loop
            # simulations holding across them lost nothing); the K = 0 one holds whatever
            # the batch or prefill
            if k and (
                load.prefill_tokens
                or k_budget < k
                or bucket != expected["bucket"]
                or min(map(_max_useful_drafts, reqs)) < k
                or (expected["max_ms"] and self._disproved(n, k, expected))
            ):
                self._settled = settled = None
            else:
                self._settled = (left - 1, k, ms, expected) if left > 1 else None
                return self._held(n, k, ms, expected, bucket, load)
        cums = self.acceptance.cumulatives(map(_request_id, reqs))  # K = 0..K_max each
        if k_budget == k_max and min(map(_max_useful_drafts, reqs)) >= k_max:
            caps, max_draft_len, full = [k_max] * n, k_max, True  # (the usual case)
            tokens = list(map(sum, zip(*cums)))[: k_max + 1]  # (acceptance's K_max may be larger)
        else:
            caps = [min(k_budget, r.max_useful_drafts) for r in reqs]
            max_draft_len = max(caps)
            full = min(caps) == max_draft_len  # every request may draft max_draft_len
            if full:
                tokens = [sum(col) for col, _ in zip(zip(*cums), range(max_draft_len + 1))]
            else:
                tokens = self._tokens(cums, caps, max_draft_len)
        # (the decode attention's share at the requests' context: StepCostModel)
        context = sum(map(_context, reqs)) if self.cost.context_ms_per_token else 0
        costs, uncapped, cells = self.cost.period_table(n, max_draft_len, extra_tokens, context)
        trimmed = None
        if max_draft_len and not self.cost.padded:  # eager verify steps: every draft costs
            trimmed = [
                trim_drafts(self.cost, cums, caps, k, extra_tokens, context)
                for k in range(max_draft_len + 1)
            ]
            tokens = [t for _, t, _ in trimmed]
            costs = [ms for _, _, ms in trimmed]
        # A step taking new work (prefill): its commits bring their successors' prefill,
        # priced in the ranking (not in predicted_ms). (Decode-only steps leave it out: in
        # the simulator, pricing it there too while requests waited lost 2% at C=512, L=3.)
        # Scaled down where the server holds less than FULL_CHARGE_OCCUPANCY of its room:
        # there arrivals (Poisson) are admitted whatever K does (`StepLoad.occupancy`).
        per_token = 0.0
        if extra_tokens:
            share = min(1.0, load.occupancy / self.FULL_CHARGE_OCCUPANCY)
            per_token = load.prefill_per_token * share
        ranking = costs
        if per_token and max_draft_len:
            queued = queued_prefill_ms(self.cost.target, n, tokens, extra_tokens, per_token)
            ranking = [ms + more for ms, more in zip(costs, queued)]
        # What drafting in a step carrying prefill costs beyond the model, measured, ranks
        # its K (now and then such a step leaves it out: drafting there measured again);
        # the modes' checks and holds compare the model's periods (`ranking`).
        priced = ranking
        drafts_beside_prefill = extra_tokens and max_draft_len and self.cost.padded
        if drafts_beside_prefill and not self.surcharge.due(costs[0]):
            surcharge = self.surcharge.ms
            if surcharge:
                priced = [ms + surcharge if k else ms for k, ms in enumerate(ranking)]
        bucket = batch_bucket(n)
        # Drafting keeps the drafter up, whose upkeep beside prefill plain decoding dormant
        # skips (`DrafterUpkeep`: 0 where the host waits for the device): a decode-only
        # step's K > 0 is charged it for each step carrying prefill there is to a
        # decode-only one, a step carrying prefill's where drafting would keep the drafter
        # from sleeping (dormant, or its bucket's decode steps prefer plain decoding); in
        # the ranking and in the checks of the modes and holds (not in the periods the
        # decision records, which the modes' factors read).
        upkeep = self.upkeep.ms if max_draft_len else 0.0
        if upkeep:
            if not extra_tokens:
                upkeep *= self.prefill_runs.per_decode_step
            elif not self.dormant and self._preferred.get(bucket) != 0:
                upkeep = 0.0
            priced = [ms + upkeep if k else ms for k, ms in enumerate(priced)]
        # The K in use: the last step's (not a probe's), else the bucket's preferred one.
        current = self._running_k
        if current is None or current > max_draft_len:
            current = self._preferred.get(bucket)
        # (an unmeasured switch is priced at a plain decode step's period: without prefill)
        sw = self.cost.switch_costs(n, None if extra_tokens else costs[0])
        # leaving it: a switch and back
        base_switch = there_and_back_row(sw, current, max_draft_len)
        switch, wake, probe_wake = base_switch, 0.0, 0.0
        if self.dormant:  # drafting first costs the batch's catch-up (a probe: its rows')
            unseen = sorted(map(_unseen, reqs))
            # (the catch-up is upkeep deferred, not lost: a wake's is spread over
            # WAKE_STEPS steps, a request's life, where a switch's over DWELL_STEPS)
            spread = self.DWELL_STEPS / self.WAKE_STEPS
            wake = spread * self.cost.catch_up_ms(sum(unseen))
            probe_wake = spread * self.cost.catch_up_ms(sum(unseen[: self.DORMANT_PROBE_ROWS]))
            switch = [ms + wake if k else ms for k, ms in enumerate(base_switch)]
        marginal = bool(extra_tokens) and self.rate.ready
        if marginal:
            # A step carrying prefill: ranked by its marginal tokens, never a probe (its
            # period measures no K; a probe under way resumes at the next decode step).
            dwell = prefill_dwell(
                self.cost, self.prefill_runs, tokens, n, context, self.DWELL_STEPS, self.HYSTERESIS
            )
            k = marginal_k(tokens, priced, switch, self.rate.price, dwell)
            probe = False
        else:
            self._bucket_steps[bucket] = self._bucket_steps.get(bucket, 0) + 1
            best = self._preferred_k(bucket, current, tokens, priced, switch, n)
            # Requests that never drafted have the global estimate only, and while plain
            # decoding is preferred nothing would tell otherwise: drafting is probed soon.
            # (Not while dormant: requests admitted then never drafted, by design.)
            unknown = (
                best == 0
                and not self.dormant
                and not any(map(self.acceptance.has_observations, (r.request_id for r in reqs)))
            )
            back = base_switch if best == current else there_and_back_row(sw, best, max_draft_len)
            probed = None
            if probe_wake:
                back = [ms + probe_wake if k else ms for k, ms in enumerate(back)]
            if self.dormant and n > self.DORMANT_PROBE_ROWS:
                # a probe drafts on a few rows only: it gains their tokens
                share = self.DORMANT_PROBE_ROWS / n
                probed = [tokens[0] + share * (t - tokens[0]) for t in tokens]
            k, probe = self._probe_k(bucket, best, n, tokens, priced, back, cells, unknown, probed)
        # Drafting that delivered less than plain decoding here, all costs in, is overruled
        # (`ModeRates`: what the steady cells do not see; retrials keep it measured).
        plain = tokens[0] / ranking[0]
        held = (
            bool(k)
            and not probe
            and self.modes.holds_back(
                bucket, self.num_steps, tokens[k] / (ranking[k] + upkeep), plain
            )
        )
        if held:
            k = 0
        favored = False
        # (Not in a step the marginal rule decided: the modes' factors are measured on
        # decode-only steps, and a prefill chunk's time in both periods makes drafting's
        # tokens per ms look better than they are; on the H100 at 256 and 512 requests,
        # acceptance 1.5, such overrules woke the dormant drafter 1-3 times a point, each
        # catching up the whole batch: 0.955 and 0.952 of plain decoding.)
        if not held and not k and not probe and not marginal and len(tokens) > 1:
            # (dormant: drafting's periods carry the wake, spread as in the ranking)
            more = wake / self.DWELL_STEPS + upkeep
            woken = [ms + (more if j else 0.0) for j, ms in enumerate(ranking)]
            top = max(range(1, len(tokens)), key=lambda j: tokens[j] / woken[j])
            drafting = tokens[top] / woken[top]
            favored = self.modes.favors_drafting(bucket, self.num_steps, drafting, plain)
            if favored:
                k = top
        if k and self.dormant and not probe:
            # A wake waits while requests wait for admission, and for evidence where it
            # catches up more requests than a probe does (see the class).
            if load.waiting:
                k = 0
            elif (
                n > self.DORMANT_PROBE_ROWS
                and self.acceptance.position_drafted[0] < self.WAKE_EVIDENCE
                and wake > probe_wake
            ):
                probe = not marginal  # (a dormant probe drafts on a few rows)
                k = k if probe else 0
        if not marginal:
            self._last_run[(bucket, k)] = self._bucket_steps[bucket]
        self._running_k = None if probe else k
        if not probe:
            if k and self.dormant:  # a wake: the batch's catch-up follows
                cause = "favored" if favored else "prefill" if extra_tokens else "decode"
                wakes = self.trace.wakes
                wakes[cause] = wakes.get(cause, 0) + 1
            self._plain_decisions = self._plain_decisions + 1 if k == 0 else 0
            self.dormant = self._plain_decisions >= self.DORMANT_AFTER
            if k == 0 and self._probe is None and (self.dormant or n >= self.SETTLE_MIN_BATCH):
                # far from drafting (every K > 0 short by SETTLE_MARGIN before any switch,
                # SETTLE_MARGIN_MANY from SETTLE_MIN_BATCH requests, or drafting held
                # back): the decision holds for a while; near it, each step deliberates
                many = n >= self.SETTLE_MIN_BATCH
                margin = self.SETTLE_MARGIN_MANY if many else self.SETTLE_MARGIN
                g0 = tokens[0] / ranking[0] * (1.0 - margin)
                if held or all(t <= g0 * (ms + upkeep) for t, ms in zip(tokens[1:], ranking[1:])):
                    expected = dict(tokens=tokens, period_ms=ranking, switch_ms=switch)
                    self._settled = (self.SETTLED_STEPS - 1, 0, costs[0], expected)
            elif (
                k
                and full
                and len(tokens) == self.k_max + 1
                and not extra_tokens
                and not favored
                and self._probe is None
                and trimmed is None
                and self.cost.padded
            ):
                # drafting K, every other K > 0 short by AWAKE_SETTLE_MARGIN and plain
                # decoding by DRAFT_SETTLE_MARGIN, corrected by the modes' factors where
                # measured (a model that favors drafting by less may be wrong: `modes`):
                # held likewise
                gk = tokens[k] / (ranking[k] + upkeep)
                drafting, plain = (
                    self.modes.rate(bucket, "drafting"),
                    self.modes.rate(bucket, "plain"),
                )
                if drafting is not None and plain is not None:
                    g0 = tokens[0] / ranking[0] * plain / drafting
                else:
                    g0 = tokens[0] / ranking[0]
                gk_other = gk * (1.0 - self.AWAKE_SETTLE_MARGIN)
                margin = self._draft_settle_margin(n, ranking[k])
                if g0 * (1.0 + margin) <= gk and all(
                    t <= gk_other * (ms + upkeep)
                    for j, (t, ms) in enumerate(zip(tokens, ranking))
                    if j and j != k
                ):
                    expected = dict(tokens=tokens, period_ms=ranking, switch_ms=switch)
                    # (decided on K's seed period: `_disproved` checks its measurement)
                    seeded = cells[k] is None or not cells[k].count
                    max_ms = tokens[k] / (g0 * (1.0 + margin)) - upkeep
                    self._settled = (
                        self.SETTLED_STEPS - 1,
                        k,
                        uncapped[k],
                        dict(expected, bucket=bucket, max_ms=max_ms if seeded else None),
                    )
        elif self.dormant and k and wake > probe_wake:
            # A probe while dormant drafts on the requests the drafter has seen most of: a
            # padded step's period is the same, their catch-up far shorter than everyone's
            # (and every request drafts whose catch-up fits a draft pass's own shape).
            draft_lens = [0] * n
            order = sorted(range(n), key=lambda i: _unseen(reqs[i]))
            for rank, i in enumerate(order):
                if rank >= self.DORMANT_PROBE_ROWS and _unseen(reqs[i]) > 2 * (k + 1):
                    break
                draft_lens[i] = min(k, caps[i])
            self.predicted_tokens = sum(c[d] for c, d in zip(cums, draft_lens))
            self.predicted_ms = self.cost.step_ms(draft_lens, extra_tokens, context)
            return self._decided(
                draft_lens,
                probe=True,
                tokens=tokens,
                period_ms=ranking,
                switch_ms=switch,
                step_ms=self.predicted_ms if extra_tokens else None,
            )
        if trimmed is None and self.cost.padded:
            # Drafts past a request's cap cost nothing in a padded step (K <= the largest
            # cap) and their tokens are dropped; one draft length for every request lets the
            # overlap loop launch the step without waiting (the scheduler keeps the context).
            if full:  # every request drafts k: the step's expected tokens are tokens[k]
                self.predicted_tokens = tokens[k]
            else:
                self.predicted_tokens = sum(c[min(k, cap)] for c, cap in zip(cums, caps))
            if extra_tokens:
                self.predicted_ms = self.cost.step_ms(
                    [min(k, c) for c in caps], extra_tokens, context
                )
            else:  # step_ms of a padded step without prefill: period_ms(n, k)
                self.predicted_ms = uncapped[k]
            self.trace.decided(
                n,
                k,
                probe=probe,
                tokens=tokens,
                period_ms=ranking,
                switch_ms=switch,
                step_ms=self.predicted_ms if extra_tokens else None,
            )
            return [k] * n
        draft_lens = [min(k, c) for c in caps]
        if trimmed is not None:
            draft_lens = self._request_probe(reqs, draft_lens, list(trimmed[k][0]))
        self.predicted_tokens = sum(c[k] for c, k in zip(cums, draft_lens))
        self.predicted_ms = self.cost.step_ms(draft_lens, extra_tokens, context)
        return self._decided(
            draft_lens,
            probe=probe,
            tokens=tokens,
            period_ms=ranking,
            switch_ms=switch,
            step_ms=self.predicted_ms if extra_tokens else None,
        )

    def _disproved(self, n: int, k: int, expected: dict) -> bool:
        """Whether a held K > 0 that was decided on its seed period (its bucket's cell not
        measured yet) has been measured since, longer than `expected["max_ms"]` (where it
        no longer beats plain decoding by DRAFT_SETTLE_MARGIN). Once confirmed, the hold
        goes on unchecked. (In the closed-loop simulator, holding on host-bound engines'
        seeds, which are device time only, drafted 16 steps at a time where plain decoding
        was best: the default model's engine at 64 requests went from 0.936 to 0.970 of
        plain decoding over 32 seeds.)"""
        if not self.cost.observations(n, k):
            return False
        if self.cost.period_ms(n, k) > expected["max_ms"]:
            return True
        expected["max_ms"] = None
        return False

    def _draft_settle_margin(self, n: int, period_ms: float) -> float:
        """How far plain decoding must trail a decision to draft for it to hold: less where
        deliberating again would cost the host FAST_STEP_SHARE of the step or more."""
        deliberation = self.DELIBERATION_MS + self.DELIBERATION_MS_PER_REQ * n
        if deliberation >= self.FAST_STEP_SHARE * period_ms:
            return self.DRAFT_SETTLE_MARGIN_FAST
        return self.DRAFT_SETTLE_MARGIN

    def _held(self, n: int, k: int, ms: float, expected: dict, bucket: int, load: StepLoad):
        """A step under a settled decision (`_settled`): K again for every request, with
        the held decision's expectations per request (scaled to this batch) and period."""
        then = expected["tokens"][0]  # (one token a request at K=0: the batch then)
        if then != n:  # the expectations per request stay the held decision's
            expected = dict(expected, tokens=[t * n / then for t in expected["tokens"]])
        if not load.prefill_tokens:
            steps = self._bucket_steps[bucket] = self._bucket_steps.get(bucket, 0) + 1
            self._last_run[(bucket, k)] = steps
        self._plain_decisions = 0 if k else self._plain_decisions + 1
        self._running_k = k
        self.trace.settled_steps += 1
        self.predicted_tokens, self.predicted_ms = expected["tokens"][k], ms
        expected = {key: v for key, v in expected.items() if key not in ("bucket", "max_ms")}
        self.trace.decided(n, k, held=True, **expected)  # (the held decision's)
        return [k] * n

    def observe_rate(self, committed: int, period_ms: float, rows: int = 0) -> None:
        """A step (any step, mixed ones included) with `rows` decoding requests committed
        this many tokens in period_ms: the server's running tokens per ms (`rate`)."""
        self.rate.observe(committed, period_ms, rows)

    def observe_mode(
        self,
        committed: int,
        period_ms: float,
        num_decoding: int,
        dormant: bool,
        expected: tuple[float, float],
    ) -> None:
        """A decode-only step of `num_decoding` requests, between decode-only steps, that
        no probe ran, committed this many tokens in period_ms where its decision `expected`
        (tokens per request, period ms): its mode's factor (`modes`) follows it, "plain"
        with the drafter dormant (`dormant`: at the step), else "drafting". Steps carrying
        prefill are left out: their tokens per request per ms follow the load's prefill, not
        the mode (a cold start's burst of prompts charged to the mode that ran first made
        drafting look 5% worse than plain decoding in the serving simulator where it was 7%
        better); so are the decode-only steps beside them (`Speculator._observe_mode`)."""
        tokens, ms = expected
        per_request = committed / num_decoding
        self.modes.observe(
            batch_bucket(num_decoding),
            "plain" if dormant else "drafting",
            per_request,
            tokens,
            period_ms,
            ms,
            self.num_steps,
        )

    @staticmethod
    def _tokens(cums: list[list[float]], caps: list[int], max_draft_len: int) -> list[float]:
        """Expected committed tokens of the step at each uniform K = 0..max_draft_len."""
        full = [c for c, cap in zip(cums, caps) if cap >= max_draft_len]
        tokens = [sum(col) for col, _ in zip(zip(*full), range(max_draft_len + 1))] if full else []
        tokens += [0.0] * (max_draft_len + 1 - len(tokens))
        for c, cap in zip(cums, caps):
            if cap < max_draft_len:
                for k in range(max_draft_len + 1):
                    tokens[k] += c[min(k, cap)]
        return tokens

    def _preferred_k(self, bucket: int, current: int | None, tokens, costs, switch, n: int) -> int:
        """The K with the best goodput, with what switching to it from the K in use and back
        costs spread over DWELL_STEPS; the K in use unless that is beaten by HYSTERESIS or,
        where periods vary more, by NOISE_Z standard errors of the two period estimates
        (unless the better K takes no longer for no fewer tokens: then the periods' noise
        cannot reverse the order)."""
        dwell = self.DWELL_STEPS
        goodput = [t / (ms + s / dwell) for t, ms, s in zip(tokens, costs, switch)]
        best = goodput.index(max(goodput))  # the first of equals
        if current is not None and current < len(goodput) and best != current:
            margin = self.HYSTERESIS
            if costs[best] > costs[current] or tokens[best] < tokens[current]:
                # (where `best` takes no longer for no fewer tokens, the periods' noise
                # cannot reverse the order)
                se = math.hypot(self.cost.error(n, best), self.cost.error(n, current))
                margin = max(margin, self.NOISE_Z * se)
            if goodput[best] <= goodput[current] * (1 + margin):
                best = current
        if len(goodput) == self.k_max + 1:  # not when requests near their end cap K
            self._preferred[bucket] = best
        return best

    def probe_len(self, k: int, best: int, period_ms: float) -> int:
        """Steps of a probe of K=k from K=best: the switch, enough steady steps to span
        PROBE_MS, and the last one, before the switch back (it carries part of that switch:
        not a steady sample)."""
        steady = min(self.PROBE_MAX_STEADY, max(1, round(self.PROBE_MS / max(period_ms, 1e-3))))
        return 1 + steady + 1  # (_probe_k computes it inline)

    def _probe_k(
        self,
        bucket: int,
        best: int,
        n: int,
        tokens,
        costs,
        back: list[float],
        cells: list,
        unknown: bool,
        probed: list[float] | None = None,
    ) -> tuple[int, bool]:
        """The K to run this step: `best`, or a probe that is due (the most overdue). `back`:
        what switching from `best` to each K and back costs; `cells`: the cost model's at n's
        bucket. `probed` (dormant, more requests than a probe drafts on): the tokens a probe
        of each K commits (its rows' gain only); then only K_max is probed (it measures
        acceptance at every depth), within DORMANT_PROBE_BUDGET of the throughput: a probe
        per K, each within its own budget and priced as if every row drafted, cost plain
        decoding 2-3% at 256 and 512 requests (serving simulator, acceptance 1.5)."""
        if self._probe is not None:
            p_bucket, p_k, left = self._probe
            if p_bucket == bucket and p_k < len(tokens) and left > 0:
                self._probe = (bucket, p_k, left - 1)
                return p_k, True
            self._probe = None
        due, probe, probe_len = 0.0, None, 0
        top, ms_best = len(tokens) - 1, costs[best]
        g_best, min_gain = tokens[best] / ms_best, self.PROBE_MIN_GAIN * n
        steps_now, last_run = self._bucket_steps[bucket], self._last_run
        every, fresh_gap, unseen_gap = self.PROBE_EVERY, self.FRESH_GAP, self.UNSEEN_GAP
        budget_ms, max_budget_ms = ms_best * self.PROBE_BUDGET, ms_best * self.PROBE_MAX_BUDGET
        max_interval, probe_ms, most = self.PROBE_MAX_INTERVAL, self.PROBE_MS, self.PROBE_MAX_STEADY
        tokens_plain = tokens[0]
        only, gained = None, tokens
        if probed is not None:
            only = top if top else None
            gained, budget_ms = probed, ms_best * self.DORMANT_PROBE_BUDGET
        for k in range(top + 1):  # one loop, no calls: it runs every step
            if k == best or (k and tokens[k] - tokens_plain < min_gain):
                continue
            if only is not None and k != only:
                continue
            ms = costs[k]
            gap = 1.0 - gained[k] / ms / g_best if g_best > 0 else 0.0
            if not gap > 0.0:  # as max(0.0, gap)
                gap = 0.0
            age = steps_now - last_run.get((bucket, k), 0)
            cell = cells[k]
            seen = cell.count if cell is not None else 0
            steps = 2 + min(most, max(1, round(probe_ms / max(ms, 1e-3))))  # probe_len
            if not seen and gap < unseen_gap and not self.cost.measured_k(k):
                tries = self._unseen_tries.get((bucket, k), 0)
                interval = 0 if tries == 0 else self.UNSEEN_RETRY << min(tries, 9)
            else:
                # A probe costs its steps' shortfall plus the switches there and back; spread
                # it out so that it is PROBE_BUDGET of the time spent at `best` in between.
                lost = steps * gap * ms + back[k]
                if only is None and best == 0 and k == top and gap < fresh_gap:
                    # (it also refreshes acceptance)
                    interval = lost / (ms_best * self.ACCEPT_PROBE_BUDGET)
                else:
                    interval = lost / budget_ms
                # min(max(interval, every * steps), max(PROBE_MAX_INTERVAL, lost / max_budget_ms))
                cap = lost / max_budget_ms
                if not cap > max_interval:
                    cap = max_interval
                if every * steps > interval:
                    interval = every * steps
                if cap < interval:
                    interval = cap
                fresh = 0 < seen < self.FRESH_OBSERVATIONS  # (dormant: within budget)
                if only is None and fresh and (gap < fresh_gap or cell.surprised):
                    interval = min(interval, every << seen)  # it may be the best, or moved
                if cell is not None and cell.doubt is not None:
                    interval = min(interval, 2 * every * steps)  # far off once: confirm or
                if unknown and gap < fresh_gap:  # dismiss it soon
                    interval = min(interval, every)
            if age >= interval and (probe is None or age - interval > due):
                due, probe, probe_len = age - interval, k, steps
        if probe is None:
            return best, False
        if not self.cost.observations(n, probe):
            self._unseen_tries[(bucket, probe)] = self._unseen_tries.get((bucket, probe), 0) + 1
        self._probe = (bucket, probe, probe_len - 1)
        return probe, True

    def _request_probe(self, reqs, full: list[int], draft_lens: list[int]) -> list[int]:
        """Acceptance is only observed at the depths drafted: a request trimmed below the
        step's K for REQUEST_PROBE_EVERY steps drafts fully once, unless its first drafts
        have proven useless, so a pessimistic estimate cannot keep it shallow for good."""
        idle = {}
        for i, r in enumerate(reqs):
            steps = 0 if draft_lens[i] >= full[i] else self._idle.get(r.request_id, 0) + 1
            alpha0 = self.acceptance.alpha(r.request_id)[0] if self.k_max else 0.0
            if steps >= self.REQUEST_PROBE_EVERY and alpha0 >= self.PROBE_MIN_ALPHA:
                draft_lens[i], steps = full[i], 0
            idle[r.request_id] = steps
        self._idle = idle
        return draft_lens
