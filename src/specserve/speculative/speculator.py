"""Everything speculative in one place: the proposer, the policy that picks draft lengths,
the acceptance and cost models it reads, and what it observed."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from specserve.core.batch import ScheduledRequest
from specserve.runtime.verify import rate_for_mean_accept_len
from specserve.speculative.acceptance import AcceptanceModel
from specserve.speculative.cost_curves import memory_bandwidth
from specserve.speculative.cost_model import StepCostModel, measure_curve, powers_of_two
from specserve.speculative.policy import (
    FixedPolicy,
    GoodputPolicy,
    OffPolicy,
    SchedulePolicy,
    SpeculationPolicy,
)
from specserve.speculative.proposer import Proposer
from specserve.speculative.registry import build_proposer
from specserve.speculative.step_periods import PeriodLog

if TYPE_CHECKING:
    from specserve.speculative.target import TargetParts

log = logging.getLogger("specserve")


class Speculator:
    """Owns speculation for an engine; the batch itself never knows about it."""

    def __init__(self, target: TargetParts):
        cfg = target.config
        self.k_max = cfg.speculative.num_steps
        # The off policy never drafts in this engine's life: the target keeps no drafter
        # inputs either (no auxiliary hidden states, no feature store writes), so a step
        # costs a plain one on the device too.
        self.never_drafts = cfg.speculative.policy == "off"
        self.proposer: Proposer = build_proposer(target)
        self.acceptance = AcceptanceModel(self.k_max)
        self.simulate_rate = None
        sim = cfg.speculative.simulate_acceptance
        if sim is not None:
            self.simulate_rate = sim if sim <= 1.0 else rate_for_mean_accept_len(sim, self.k_max)
            log.warning(
                "SIMULATED ACCEPTANCE (rate %.3f per draft token): outputs are not the "
                "model's; use only to benchmark random-weight models",
                self.simulate_rate,
            )
        self.cost: StepCostModel | None = None
        self.policy: SpeculationPolicy = OffPolicy(self.k_max)
        self.periods = PeriodLog(None)  # step periods into the cost model (goodput only)
        self.clear_step_history()

    def clear_step_history(self) -> None:
        """Forget the steps before (what `observe_period` compares the next one with)."""
        self._last_decodes = False  # whether the last step was decode-only
        self._last_resolved_s: float | None = None
        self._last_committed = 0
        self._last_drafted = False  # the last step with decode rows drafted (the surcharge)
        # a decode-only step's mode observation, until the step after it says whether it
        # was interior (`observe_period`)
        self._mode_pending: tuple | None = None

    def start(self, target: TargetParts) -> None:
        """Build the policy once the target runs as it will serve (graphs captured), so the
        cost model measures the real step times."""
        self.policy = self._build_policy(target)

    def follow(self) -> None:
        """A rank > 0 under tensor parallelism: rank 0's policy decides each step's draft
        lengths and whether the drafter is kept up to date (its step plans say so); this
        rank keeps no policy of its own (its start-up measured in step with rank 0's)."""
        self.policy = OffPolicy(self.k_max)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose hidden states the drafter reads (none under off)."""
        return () if self.never_drafts else self.proposer.aux_layer_ids

    def feature_writer(self):
        """The proposer's in-graph feature writer (see Proposer), none under off."""
        return None if self.never_drafts else self.proposer.feature_writer()

    @property
    def may_draft(self) -> bool:
        """False under the off policy: no step drafts, so the scheduler asks no policy, the
        drafter is not caught up along the way (its inputs stay available: a later policy
        catches up on them) and steps leave no statistics; a step costs a plain one."""
        return not isinstance(self.policy, OffPolicy)

    @property
    def keeps_drafter(self) -> bool:
        """Whether the drafter is kept up to date as requests go (prompt chunks and
        ride-alongs caught up): unless no step drafts (off) or the policy is dormant (it
        has chosen plain decoding for long; the drafter catches up when drafting resumes)."""
        return self.may_draft and not getattr(self.policy, "dormant", False)

    @property
    def scheduling_policy(self) -> SpeculationPolicy | None:
        """The policy the scheduler asks for draft lengths (None: every K is 0)."""
        return self.policy if self.may_draft else None

    def _build_policy(self, target: TargetParts) -> SpeculationPolicy:
        cfg = target.config
        name = cfg.speculative.policy
        if name == "off":
            return OffPolicy(self.k_max)
        if name == "fixed":
            return FixedPolicy(self.k_max)
        if name == "schedule":
            return SchedulePolicy(self.k_max, cfg.speculative.schedule)
        self.cost = self.periods.cost = self.measure_costs(target)
        return GoodputPolicy(self.k_max, self.cost, self.acceptance)

    def measure_costs(self, target: TargetParts) -> StepCostModel:
        """Seed the step cost model: the target timed by tokens per step and the drafter by
        batch on this machine; real steps' periods refine it (`observe_period`)."""
        runner, cfg = target.runner, target.config
        limit = min(
            cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs * (self.k_max + 1)
        )
        # Under tensor parallelism every rank times the same sizes (their forwards' collectives
        # pair up), so no rank may stop early on its own clock.
        budget_s = None if cfg.parallel.tensor_parallel_size > 1 else 4.0
        forward = measure_curve(runner.time_forward, powers_of_two(limit), budget_s=budget_s)
        drafter = None
        timer = self.proposer.step_timer()
        if timer is not None:
            sizes = powers_of_two(cfg.scheduler.max_num_seqs)
            drafter = measure_curve(timer, sizes, budget_s=budget_s)
        # With CUDA graphs, decode/verify steps pad every request to the step's longest draft.
        cost = StepCostModel(forward, drafter, padded=runner.graphs is not None)
        # Decode attention reads each context token's KV once a step (memory-bound).
        pool = target.kv.pool  # (layers, K and V, pages, page size, heads, head dim)
        bandwidth = memory_bandwidth(pool.device)
        if bandwidth:
            cost.context_ms_per_token = pool[:, :, 0, 0].numel() * pool.element_size() / bandwidth
            log.info(
                "decode attention priced at %.3g ms a context token (%.2f TB/s)",
                cost.context_ms_per_token,
                bandwidth / 1e9,
            )
        elif pool.device.type == "cuda":
            log.warning("memory bandwidth not measured: decode attention left out of step costs")
        return cost

    def observe(
        self,
        batch: list[ScheduledRequest],
        committed: dict[int, int],
        draft_ms: float,
        target_ms: float,
    ) -> None:
        """After a step: acceptance per request, decision trace."""
        if not self.may_draft:
            return
        draft_lens = [len(s.drafts) for s in batch if s.decoding]  # (this runs every step)
        if any(draft_lens):
            get = committed.get
            verified = [
                (s.request.request_id, len(s.drafts), get(id(s), 1) - 1)
                for s in batch
                if s.decoding and s.drafts
            ]
            self.acceptance.update_many(verified)
        policy = self.policy
        trace = policy.trace
        trace.record(draft_lens)
        self._last_committed = total = sum(committed.values())
        total_ms = draft_ms + target_ms
        if total_ms > 0:
            trace.observed_goodput = total / total_ms * 1e3
        if policy.predicted_ms > 0:
            trace.predicted_goodput = policy.predicted_tokens / policy.predicted_ms * 1e3

    def observe_period(
        self,
        batch: list[ScheduledRequest],
        resolved_s: float,
        after_idle: bool,
        device_ms: float | None = None,
        kept_drafter: bool | None = None,
        waited: bool = False,
        upkeep: tuple[float, float] | None = None,
    ) -> None:
        """A step's period: from the previous step's tokens reaching the host to its own
        (`resolved_s`, perf_counter seconds), which is what a step costs in throughput under
        the synchronous and the overlapped loop alike. Steps are processed in launch order.
        Decode-only steps go to the period log (with their period when the step before was
        decode-only too and the engine did not idle between), which decides with one step of
        hindsight which are steady samples of their K and what a change of K cost
        (`PeriodLog`); any other step ends its chain. The policy's trace gets the period and
        its use, and the step's device span (`device_ms`, None where untimed).
        `kept_drafter`: whether the drafter was kept up in the step, as launched (under
        overlap the policy has decided the next step since: a wake's step ran dormant);
        None: as the policy is now (synchronous steps). `waited`: launched after waiting
        for the step before it. `upkeep`: in a step carrying prefill with the drafter kept
        up, the host ms of the drafter's upkeep and of the host's wait for the step's tokens
        (`DrafterUpkeep`)."""
        if not self.may_draft:  # the off policy: nothing to learn
            return
        decoding = [s for s in batch if s.decoding]
        only_decodes = bool(decoding) and len(decoding) == len(batch)
        prev_decodes, prev_s = self._last_decodes, self._last_resolved_s
        self._last_decodes, self._last_resolved_s = only_decodes, resolved_s
        decision = None
        max_draft_len = max([len(s.drafts) for s in decoding]) if decoding else 0
        trace = self.policy.trace
        if decoding:
            decision, _ = trace.processed(len(decoding), max_draft_len)
        dormant = not (self.keeps_drafter if kept_drafter is None else kept_drafter)
        if dormant:
            trace.dormant_steps += 1
        period_ms = None
        committed, self._last_committed = self._last_committed, 0  # (observe sets it)
        if prev_s is not None and resolved_s > prev_s and not after_idle:
            period_ms = (resolved_s - prev_s) * 1e3
            if decoding:
                # (decode-only with the drafter kept up: "awake", its ride-alongs' upkeep)
                parts = ("dormant",) * dormant + ("prefill",) * (not only_decodes)
                parts += ("awake",) * (only_decodes and not dormant)
                trace.timed(max_draft_len, period_ms, device_ms, parts)
            if decision is not None:  # (a step with decodes: `parts` is set)
                decision.observed_ms, decision.device_ms = period_ms, device_ms
                decision.parts = "+".join(parts)
            observe_rate = getattr(self.policy, "observe_rate", None)
            if observe_rate is not None:
                observe_rate(committed, period_ms, len(decoding))
        self._observe_mode(
            only_decodes and prev_decodes and period_ms is not None,
            committed,
            period_ms,
            len(decoding),
            dormant,
            decision,
            max_draft_len,
        )
        if upkeep is not None and decoding and not only_decodes and not dormant:
            if decision is not None:
                decision.upkeep_ms, decision.wait_ms = upkeep
            upkeeps = getattr(self.policy, "upkeep", None)
            if upkeeps is not None:
                upkeeps.observe(max(0.0, upkeep[0] - upkeep[1]))
        surcharge = getattr(self.policy, "surcharge", None)
        if surcharge is not None:
            usable = not dormant and not after_idle and not waited
            self._observe_surcharge(
                surcharge,
                decoding,
                only_decodes,
                max_draft_len,
                decision,
                period_ms if usable else None,
            )
        if not only_decodes:
            self.periods.stop()
            return
        if period_ms is not None:
            trace.observed_goodput = committed / period_ms * 1e3
        cost = self.periods.cost
        context = 0
        if cost is not None and cost.context_ms_per_token:
            context = sum([s.request.cached_len for s in decoding])
        self.periods.add(
            len(decoding), max_draft_len, period_ms if prev_decodes else None, decision, context
        )

    def _observe_mode(
        self, interior: bool, committed: int, period_ms, n: int, dormant: bool, decision, k: int
    ) -> None:
        """The modes' factors (`GoodputPolicy.observe_mode`) learn from decode-only steps
        between decode-only steps (`interior`: this one follows one, with a period), decided
        with one step of hindsight, as the cost model's steady samples are: a decode-only
        step beside one carrying prefill takes part of that step's host work in its period
        (the launch of an eager step, the new requests' first tokens), which follows the
        load, not the mode. On an H100 at 0.9 of plain decoding's peak (L = 1.5, 256
        clients, Poisson arrivals) plain decoding's factor, measured over all decode-only
        steps while the load ran high, fell to 0.63-0.64 against drafting's 0.87-0.92
        (measured while it ran lower), and overruled plain decoding for drafting, which lost
        (0.70 of the best, sessions 51-52). Probes count for neither mode."""
        pending, self._mode_pending = self._mode_pending, None
        observe_mode = getattr(self.policy, "observe_mode", None)
        if not interior or observe_mode is None:
            return
        if pending is not None:
            observe_mode(*pending)
        expected = _expected(decision, k)
        if expected is not None and not decision.probe:
            self._mode_pending = (committed, period_ms, n, dormant, expected)

    def _observe_surcharge(
        self, surcharge, decoding, only_decodes: bool, k: int, decision, ms
    ) -> None:
        """Drafting's surcharge beside prefill (`DraftingSurcharge`): a step carrying prefill
        with decode rows, whose decision predicted its period at the K it ran, took `ms`, its
        period (None: not comparable), plain ones between drafting steps included. A
        drafting step counts only after a drafting step (after a plain one it holds the
        rows' catch-up: a switch or a wake brings that backlog, priced apart: `PeriodLog`,
        the wake); the loop leaves out dormant plain steps (no upkeep, which drafting
        needs), steps after an idle engine or a wait for the step before."""
        drafted, after_drafting = k > 0, self._last_drafted
        self._last_drafted = bool(decoding) and drafted
        if only_decodes or not decoding or ms is None or decision is None:
            return
        if drafted and not after_drafting:
            return
        predicted = decision.step_ms
        if predicted is not None and decision.k == k and decision.num_reqs == len(decoding):
            surcharge.observe(drafted, ms, predicted)

    def write_trace(self, path: str) -> None:
        """The policy's recent decisions (`PolicyTrace.recent`, oldest first) and the
        figures of `stats` as JSON at `path` (`--speculative-trace-file`: how each step's K
        was chosen and what it cost, for diagnostics)."""
        record = {"stats": self.stats(), "decisions": self.policy.trace.dump()}
        try:
            with open(path, "w") as f:
                json.dump(record, f, default=str)
        except OSError as e:  # (at shutdown: said, not raised, so that the engine stops)
            log.error("speculation trace not written to %s: %s", path, e)

    def stats(self) -> dict:
        """Speculation figures for metrics: decisions, acceptance, goodput; and for the
        goodput policy the tables it decides by (`spec_policy_*`: the cost model's steady
        periods and switch costs, the modes' factors, each keyed "bucket:K|direction|mode")."""
        trace = self.policy.trace
        tables = {}
        policy = self.policy
        parts = ("modes", "surcharge", "upkeep", "rate")
        for source in (self.cost, *(getattr(policy, a, None) for a in parts)):
            if source is not None:
                tables.update({f"spec_policy_{k}": v for k, v in source.snapshot().items()})
        tables.update({f"spec_policy_{k}": v for k, v in trace.expectations().items()})
        return {
            **tables,
            "spec_policy": type(self.policy).__name__,
            "spec_simulated_acceptance": self.simulate_rate is not None,
            "spec_steps_by_draft_len": list(trace.steps_by_draft_len),
            "spec_steps_by_step_k": list(trace.steps_by_step_k),
            "spec_probe_steps": trace.probe_steps,
            "spec_switches": trace.switches,  # steps crossing between plain and drafting
            "spec_k_changes": trace.k_changes,
            "spec_last_draft_lens": list(trace.last_draft_lens),
            "spec_predicted_goodput": trace.predicted_goodput,
            "spec_observed_goodput": trace.observed_goodput,
            "spec_position_drafted": list(self.acceptance.position_drafted),
            "spec_position_accepted": list(self.acceptance.position_accepted),
            "spec_period_ms_by_step_k": list(trace.period_ms_by_step_k),
            "spec_timed_steps_by_step_k": list(trace.timed_steps_by_step_k),
            "spec_device_ms_by_step_k": list(trace.device_ms_by_step_k),
            "spec_dormant_steps": trace.dormant_steps,
            "spec_settled_steps": trace.settled_steps,
            "spec_plain_ms_by_part": dict(trace.plain_ms_by_part),
            "spec_plain_device_ms_by_part": dict(trace.plain_device_ms_by_part),
            "spec_plain_steps_by_part": dict(trace.plain_steps_by_part),
            "spec_drafting_held": getattr(getattr(self.policy, "modes", None), "num_held", 0),
            "spec_plain_overruled": getattr(getattr(self.policy, "modes", None), "num_favored", 0),
            "spec_wakes": dict(trace.wakes),
            "spec_drafter_eager_passes": self.proposer.eager_passes,
            "spec_drafter_eager_tokens": self.proposer.eager_tokens,
        }


def _expected(decision, k: int) -> tuple[float, float] | None:
    """What a step's decision expected of it at the step's K: committed tokens per request
    and the period (ms); None where it said nothing (policies other than goodput, a step
    whose budget left no choice)."""
    if decision is None or decision.tokens is None or decision.period_ms is None:
        return None
    k = min(k, len(decision.tokens) - 1, len(decision.period_ms) - 1)
    return decision.tokens[k] / decision.num_reqs, decision.period_ms[k]
