"""Step cost model: what a whole step of a given shape costs, in wall-clock milliseconds.

Seeds come from start-up measurements (the target's forward by tokens per step, one drafter
pass by batch). They leave out what only real steps show: host work of speculative steps
(proposing, verification, processing), graph padding, drafter passes that run without a
whole-chain graph, and the overlap of host and device work. So the policy's costs are an
online table of whole-step periods keyed by (batch bucket, draft length K): each cell holds
an exponentially weighted ratio of observed period to seed, so the seed's shape within a
bucket is kept and the level is what steps of that shape actually took. A switch of K pays
one-off costs (a drafter catch-up, a host wait that overlap would have hidden), in the
steps around it: those are their own online table, by bucket and direction of the switch
(step_periods.py decides which periods are steady samples and which belong to a switch).
"""

from __future__ import annotations

import math

from specserve.speculative.buckets import batch_bucket, nearest_bucket
from specserve.speculative.cost_curves import CurveModel, measure_curve, powers_of_two
from specserve.speculative.robust_mean import RobustMean
from specserve.speculative.switch_costs import (
    SwitchCosts,
    direction,
    there_and_back,
    there_and_back_row,
)

__all__ = [
    "CurveModel",
    "RobustMean",
    "StepCostModel",
    "batch_bucket",
    "measure_curve",
    "powers_of_two",
    "there_and_back",
    "there_and_back_row",
]


class StepCostModel:
    """Predicted wall-clock ms of a step: `n` decoding requests with draft lengths
    `draft_lens` (K = max(draft_lens) sets the shape), plus `extra_tokens` prefill tokens;
    and what the first step at a new K costs on top (`switch_ms`).

    period(n, K) = seed(n, K) * ratio[bucket(n), K]; seed = target(n (K+1)) + K drafter(n).
    A cell without observations interpolates the periods of the nearest buckets measured
    below and above it, else borrows the ratio of the nearest observed bucket with the same
    K, else of the nearest observed K at its bucket, else takes the seed. `padded`: verify steps
    pad every request to K drafts (CUDA graphs), so shorter drafts save nothing; otherwise
    each draft not verified saves its share of the target's time. Ratios are robust means
    in log space (outliers cut). Switch costs are their own table (`SwitchCosts`, by bucket
    and direction); a switch there and back costs the sum of both directions.

    Decode attention reads every context token's KV once a step, whatever K: a step's
    period grows with its decoding requests' summed context (`context` tokens), by
    `context_ms_per_token` each (the KV's bytes per token over the device's memory bandwidth,
    set at start-up; 0: not modelled). The cells learn periods with that term taken out and
    every prediction adds it back at the step's own context, so cells measured at other
    contexts compare fairly: as requests grow, a cell read late would otherwise say a K is
    dearer or cheaper than another read early (on the 8B shape at 256 requests, 512 to 768
    tokens of context are 4.3 to 6.4 ms of a ~13 ms step).
    """

    WEIGHT = 0.15  # EWMA weight of an observation in a cell observed every step
    STALE_AGE = 16  # observations of other cells after which a cell's estimate is stale
    STALE_WEIGHT = 0.5  # what an observation of a stale cell weighs (probes)
    SURPRISE = 1.25
    CLAMP = 3.0  # the first YOUNG observations of a cell move its ratio by at most this
    CUT = 0.25  # factor; others by at least exp(CUT) (more if periods vary more)
    YOUNG = 3
    CONTEXT_FLOOR = 0.1  # of a period left after its context's term (a bound, not a model)
    SWITCH_PRIOR = 0.5  # an unmeasured switch to or from plain decoding: half a plain step
    # Which cells a period or a switch cost reads depends only on which cells exist: those
    # read plans are memoized until a cell is added (the policy reads them every step).
    memoize = True

    def __init__(self, target: CurveModel, drafter: CurveModel | None, padded: bool = False):
        self.target = target
        self.drafter = drafter
        self.padded = padded
        self._cells: dict[tuple[int, int], RobustMean] = {}  # (bucket, K) -> log ratio
        self.switches = SwitchCosts(self.CUT, self.YOUNG)  # switch_costs, observe_switch
        self._measured_ks: set[int] = set()
        self._clock = 0
        self._seeds: dict[tuple[int, int], float] = {}
        self._plans: dict[tuple, tuple] = {}  # read plans (`memoize`)
        self.context_ms_per_token = 0.0  # decode attention's KV read (see the class)

    def context_ms(self, context: int) -> float:
        """The decode attention's share of a step whose decoding requests hold `context`
        tokens of KV between them."""
        return self.context_ms_per_token * context

    def seed_ms(self, n: int, k: int) -> float:
        ms = self._seeds.get((n, k))
        if ms is None:  # the curves are fixed once measured
            ms = self.target(n * (k + 1))
            if k and self.drafter is not None:
                ms += k * self.drafter(n)
            self._seeds[(n, k)] = ms
        return ms

    def period_ms(self, n: int, k: int, extra_tokens: int = 0, context: int = 0) -> float:
        """A step of n requests all drafting k, plus prefill tokens, the requests holding
        `context` tokens. A batch bucket where K=k was not measured, between two where it
        was, interpolates their periods linearly in the batch size (host work grows by the
        request, and does not scale with the seeds: SmolLM2 on the H200 took 1.82 ms at K=3
        and batch 1, 2.19 at 8, 4.2-5.2 at 64)."""
        ms = _read(self._plan((n, k, extra_tokens), self._period_plan))
        return ms + self.context_ms(context) if context else ms

    def _period_plan(self, n: int, k: int, extra_tokens: int) -> tuple:
        """What period_ms(n, k, extra_tokens) reads: (seed, cell, extra ms) or, between two
        measured buckets, (seed, cell, extra ms, seed, cell, n - lo, hi - lo); cell None: the
        seed as it is."""
        extra = 0.0
        if extra_tokens:
            verify = n * (k + 1)
            extra = self.target(verify + extra_tokens) - self.target(verify)
        bucket = batch_bucket(n)
        if (bucket, k) not in self._cells:
            below = [b for (b, kk) in self._cells if kk == k and b < bucket]
            above = [b for (b, kk) in self._cells if kk == k and b > bucket]
            if below and above:
                lo, hi = max(below), min(above)
                return (
                    self.seed_ms(lo, k),
                    self._cells[(lo, k)],
                    extra,
                    self.seed_ms(hi, k),
                    self._cells[(hi, k)],
                    n - lo,
                    hi - lo,
                )
        return self.seed_ms(n, k), self._ratio_cell(bucket, k), extra

    def _ratio_cell(self, bucket: int, k: int):
        """The cell whose ratio a period at (bucket, k) takes (see the class), or None."""
        cell = self._cells.get((bucket, k))
        if cell is None:
            cell = nearest_bucket(self._cells, bucket, k)
            if cell is None:
                # Host overhead missing from the seeds is shared by every K of a batch size.
                here = [kk for (b, kk) in self._cells if b == bucket]
                if not here:
                    return None
                cell = self._cells[(bucket, min(here, key=lambda kk: (abs(kk - k), kk)))]
        return cell

    def ratio(self, bucket: int, k: int) -> float:
        cell = self._ratio_cell(bucket, k)
        return 1.0 if cell is None else math.exp(cell.value)

    def _plan(self, key: tuple, make):
        """make(*key), memoized while no cell is added (`memoize`)."""
        if not self.memoize:
            return make(*key)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 1024:  # prefill sizes vary: keep it bounded
                self._plans.clear()
            plan = self._plans[key] = make(*key)
        return plan

    def periods_ms(self, n: int, max_draft_len: int, extra_tokens: int = 0) -> list[float]:
        """period_ms for K = 0..max_draft_len, none above a larger K's measured at this batch
        bucket: a step with fewer drafts does less work, so a cell estimated higher (few
        observations, or borrowed) is taken at the larger K's period."""
        return self.period_table(n, max_draft_len, extra_tokens)[0]

    def period_table(
        self, n: int, max_draft_len: int, extra_tokens: int = 0, context: int = 0
    ) -> tuple:
        """What the policy reads each step, in one lookup: (periods_ms(n, max_draft_len,
        extra_tokens), [period_ms(n, k, extra_tokens) for K = 0..max_draft_len] (not capped),
        cells(n, max_draft_len)), each period at the step's `context`."""
        reads, cells = self._plan((n, max_draft_len, extra_tokens, "all"), self._periods_plan)
        exp, raw = math.exp, []
        for plan in reads:  # _read, inlined
            if len(plan) == 3:
                seed, cell, extra = plan
                ms = seed * exp(cell.value) if cell is not None else seed * 1.0
                if extra:
                    ms += extra
                raw.append(ms)
            else:
                raw.append(_read(plan))
        out, cap = list(raw), math.inf
        for k in range(max_draft_len, -1, -1):
            if cap < out[k]:  # min(out[k], cap)
                out[k] = cap
            cell = cells[k]
            if cell is not None and cell.count:
                cap = out[k]
        if context and self.context_ms_per_token:
            ms = self.context_ms(context)
            out, raw = [x + ms for x in out], [x + ms for x in raw]
        return out, raw, cells

    def _periods_plan(self, n: int, max_draft_len: int, extra_tokens: int, _) -> tuple:
        bucket = batch_bucket(n)
        reads = [self._period_plan(n, k, extra_tokens) for k in range(max_draft_len + 1)]
        return reads, [self._cells.get((bucket, k)) for k in range(max_draft_len + 1)]

    def cells(self, n: int, max_draft_len: int) -> list:
        """The table's cells (`RobustMean`, read only; None where not measured) at n's bucket
        for K = 0..max_draft_len: what observations, doubtful and surprised read, in one
        lookup."""
        return self._plan((n, max_draft_len, 0, "all"), self._periods_plan)[1]

    def step_ms(self, draft_lens: list[int], extra_tokens: int = 0, context: int = 0) -> float:
        """A step with these per-request draft lengths (nonempty), at `context`."""
        n, max_draft_len = len(draft_lens), max(draft_lens)
        ms = self.period_ms(n, max_draft_len, extra_tokens, context)
        if not self.padded or extra_tokens:
            full = n * (max_draft_len + 1) + extra_tokens
            padding = n * max_draft_len - sum(draft_lens)
            ms -= self.target(full) - self.target(full - padding)
        return ms

    def measured_k(self, k: int) -> bool:
        """Whether steps of draft length k have been measured at any batch size."""
        return k in self._measured_ks

    def surprised(self, n: int, k: int) -> bool:
        """Whether the cell's last observation, after a pause, was far from its estimate."""
        cell = self._cells.get((batch_bucket(n), k))
        return cell is not None and cell.surprised

    def error(self, n: int, k: int) -> float:
        """The relative standard error of an established period_ms(n, k): the cell's spread
        of observations (a mean absolute deviation, in log) over the observations a WEIGHT
        average spans; 0 for a cell not observed. (Young cells are measured again soon
        instead: the policy does not wait for them to settle.)"""
        cell = self._cells.get((batch_bucket(n), k))
        if cell is None or not cell.count:
            return 0.0
        return 1.25 * cell.spread * math.sqrt(self.WEIGHT / (2 - self.WEIGHT))

    def observations(self, n: int, k: int) -> int:
        cell = self._cells.get((batch_bucket(n), k))
        return cell.count if cell is not None else 0

    def doubtful(self, n: int, k: int) -> bool:
        """Whether the cell's last observation was far off and not confirmed yet."""
        cell = self._cells.get((batch_bucket(n), k))
        return cell is not None and cell.doubt is not None

    def observe(self, n: int, k: int, period_ms: float, context: int = 0) -> None:
        """A steady step (same K as the steps before and after it) of n decoding requests,
        holding `context` tokens, took period_ms from the previous step's tokens to its own
        (learned without its context's term, down to CONTEXT_FLOOR of it). The first YOUNG
        observations of
        a cell average (each within a factor CLAMP: the seed may be far off), the next weigh
        1/(count + 1) down to WEIGHT; one after STALE_AGE observations of other cells (a
        probe of a K not in use) weighs STALE_WEIGHT. An observation far off (past CUT and
        the cell's spread) is cut and weighs at most WEIGHT, so one slow step moves an
        estimate little, in a probe too (on the H200 one short step once reset a batch-1 K=3
        cell of 368 observations), while a lasting change widens the spread and is followed
        within a few. A probe's far observation is `doubtful` (the policy measures it again
        soon); if the next one is far on the same side too, the period changed while the K
        was not in use: the cell moves to them at once, counts as new and, if that moved it
        by more than a factor SURPRISE, is flagged as surprised."""
        seed = self.seed_ms(n, k)
        if seed <= 0 or period_ms <= 0:
            return
        if context:
            period_ms = max(period_ms - self.context_ms(context), period_ms * self.CONTEXT_FLOOR)
        key = (batch_bucket(n), k)
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = RobustMean(math.log(self.ratio(*key)), self.CUT / 2)
            self._measured_ks.add(k)
            self._plans.clear()
        self._clock += 1
        x = math.log(period_ms / seed)
        stale = cell.count and self._clock - cell.last > self.STALE_AGE
        cell.last = self._clock
        if cell.count < self.YOUNG:  # the seed may be far off, and no mean is established
            cell.update(x, 1.0 / (cell.count + 1), math.log(self.CLAMP))
            cell.surprised = False
            return
        far = cell.far(x, self.CUT)
        if far and cell.doubt is not None and (cell.doubt > cell.value) == (x > cell.value):
            before = cell.value
            cell.value = (cell.doubt + x) / 2
            cell.count, cell.doubt = 1, None
            cell.surprised = abs(cell.value - before) > math.log(self.SURPRISE)
            return
        cell.doubt = x if far and stale else None
        weight = self.STALE_WEIGHT if stale else max(self.WEIGHT, 1.0 / (cell.count + 1))
        cell.update(x, min(weight, self.WEIGHT) if far else weight, self.CUT)
        cell.surprised = False

    def snapshot(self) -> dict:
        """The online tables as plain data (diagnostics, the engine's stats): "bucket:K" ->
        the steady period (ms) of a step of `bucket` requests at K, without the decode
        attention's context term, and its observations; "bucket:direction" -> a switch's
        cost (ms) and its observations. Measured cells only."""
        cells = sorted(self._cells.items())
        switches = sorted(self.switches.cells.items())
        return {
            "period_ms": {
                f"{b}:{k}": self.seed_ms(b, k) * math.exp(c.value) for (b, k), c in cells
            },
            "period_observations": {f"{b}:{k}": c.count for (b, k), c in cells},
            "switch_ms": {f"{b}:{d}": c.value for (b, d), c in switches},
            "switch_observations": {f"{b}:{d}": c.count for (b, d), c in switches},
        }

    def switch_ms(self, n: int, k_from: int, k_to: int) -> float:
        """What a switch from K=k_from to k_to costs beyond steady steps (may be negative)."""
        if k_from == k_to:
            return 0.0
        return self.switch_costs(n)[direction(k_from, k_to)]

    def catch_up_ms(self, tokens: int) -> float:
        """A drafter's catch-up over `tokens` tokens (bounded passes of many tokens each):
        its per-token cost at the largest batch start-up measured, where a pass costs
        about in proportion to its tokens; 0 without a drafter curve."""
        drafter = self.drafter
        if drafter is None or tokens <= 0:
            return 0.0
        largest = drafter.sizes[-1]
        return drafter(largest) / largest * tokens

    def switch_costs(self, n: int, plain_ms: float | None = None) -> dict[str, float]:
        """switch_ms by direction ("up", "down", "lateral") at batch size n. A bucket without
        measurements borrows the nearest measured bucket's; unmeasured anywhere: switching
        to or from plain decoding costs SWITCH_PRIOR of a plain step (`plain_ms` if the
        caller knows it), between K > 0 nothing. One direction may be negative; a switch
        there and back costs the sum (`there_and_back`). Read only (it may be cached)."""
        return self.switches.costs(
            n, lambda: self.SWITCH_PRIOR * (plain_ms or self.period_ms(n, 0)), self.memoize
        )

    def switch_measured(self, n: int) -> bool:
        """Whether switches to and from plain decoding were measured at n's bucket (at
        least YOUNG times each, not borrowed from another bucket nor the prior)."""
        cells, bucket = self.switches.cells, batch_bucket(n)
        up, down = cells.get((bucket, "up")), cells.get((bucket, "down"))
        return up is not None and down is not None and min(up.count, down.count) >= self.YOUNG

    def observe_switch(
        self, n: int, k_from: int, k_to: int, excess_ms: float, steady_ms: float
    ) -> None:
        """A switch from K=k_from to k_to cost excess_ms beyond steady steps (`PeriodLog`:
        the step before it and the first after it, less the steady ones on either side);
        steady_ms, the new K's steady period, scales the outlier cut (`SwitchCosts`)."""
        self.switches.observe(
            n, k_from, k_to, excess_ms, steady_ms, lambda: self.SWITCH_PRIOR * self.period_ms(n, 0)
        )


def _read(plan: tuple) -> float:
    """A period from its read plan (`StepCostModel._period_plan`)."""
    if len(plan) == 3:
        seed, cell, extra = plan
        ms = seed * math.exp(cell.value) if cell is not None else seed * 1.0
    else:
        seed_lo, cell_lo, extra, seed_hi, cell_hi, dn, span = plan
        ms_lo = seed_lo * math.exp(cell_lo.value)
        ms_hi = seed_hi * math.exp(cell_hi.value)
        ms = ms_lo + (ms_hi - ms_lo) * dn / span
    if extra:
        ms += extra
    return ms
