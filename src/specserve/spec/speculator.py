"""Everything speculative in one place: the proposer, the policy that picks draft lengths,
the acceptance and cost models it reads, and what it observed."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from specserve.engine.scheduler import ScheduledRequest
from specserve.spec.acceptance import AcceptanceModel
from specserve.spec.cost_model import StepCostModel, measure_curve, powers_of_two
from specserve.spec.policy import (
    FixedPolicy,
    GoodputPolicy,
    OffPolicy,
    SchedulePolicy,
    SpeculationPolicy,
)
from specserve.spec.proposer import Proposer
from specserve.spec.registry import build_proposer
from specserve.spec.verify import rate_for_mean_accept_len

if TYPE_CHECKING:
    from specserve.engine.engine import LLMEngine

log = logging.getLogger("specserve")


class Speculator:
    """Owns speculation for an engine; the batch itself never knows about it."""

    def __init__(self, engine: LLMEngine):
        cfg = engine.config
        self.k_max = cfg.speculative_num_steps
        self.proposer: Proposer = build_proposer(engine)
        self.acceptance = AcceptanceModel(self.k_max)
        self.simulate_rate = None
        sim = cfg.speculative_simulate_acceptance
        if sim is not None:
            self.simulate_rate = sim if sim <= 1.0 else rate_for_mean_accept_len(sim, self.k_max)
            log.warning(
                "SIMULATED ACCEPTANCE (rate %.3f per draft token): outputs are not the "
                "model's; use only to benchmark random-weight models",
                self.simulate_rate,
            )
        self.cost: StepCostModel | None = None
        self.policy: SpeculationPolicy = OffPolicy(self.k_max)
        self._last_shape: tuple[int, int] | None = None  # (decoding requests, K) of the last step
        self._last_resolved_s: float | None = None
        self._last_committed = 0
        self._last_switch: tuple[int, int, float] | None = None  # (K before, K, period ms)

    def start(self, engine: LLMEngine) -> None:
        """Build the policy once the target runs as it will serve (graphs captured), so the
        cost model measures the real step times."""
        self.policy = self._build_policy(engine)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.proposer.aux_layer_ids

    def _build_policy(self, engine: LLMEngine) -> SpeculationPolicy:
        cfg = engine.config
        name = cfg.speculative_policy
        if name == "off":
            return OffPolicy(self.k_max)
        if name == "fixed":
            return FixedPolicy(self.k_max)
        if name == "schedule":
            return SchedulePolicy(self.k_max, cfg.speculative_schedule)
        self.cost = self.measure_costs(engine)
        return GoodputPolicy(self.k_max, self.cost, self.acceptance)

    def measure_costs(self, engine: LLMEngine) -> StepCostModel:
        """Seed the step cost model: the target timed by tokens per step and the drafter by
        batch on this machine; real steps' periods refine it (`observe_period`)."""
        runner = engine.runner
        limit = min(
            engine.config.max_num_batched_tokens,
            engine.config.max_num_seqs * (self.k_max + 1),
        )
        target = measure_curve(runner.time_forward, powers_of_two(limit))
        drafter = None
        timer = self.proposer.step_timer()
        if timer is not None:
            drafter = measure_curve(timer, powers_of_two(engine.config.max_num_seqs))
        # With CUDA graphs, decode/verify steps pad every request to the step's longest draft.
        return StepCostModel(target, drafter, padded=runner.graphs is not None)

    def observe(
        self,
        batch: list[ScheduledRequest],
        committed: dict[int, int],
        draft_ms: float,
        target_ms: float,
    ) -> None:
        """After a step: acceptance per request, decision trace."""
        decoding = [s for s in batch if s.decoding]
        self.acceptance.update_many([
            (s.request.request_id, len(s.drafts), committed.get(id(s), 1) - 1)
            for s in decoding if s.drafts
        ])  # fmt: skip
        self.policy.trace.record([len(s.drafts) for s in decoding])
        self._last_committed = sum(committed.values())
        total_ms = draft_ms + target_ms
        if total_ms > 0:
            self.policy.trace.observed_goodput = self._last_committed / total_ms * 1e3
        if self.policy.predicted_ms > 0:
            self.policy.trace.predicted_goodput = (
                self.policy.predicted_tokens / self.policy.predicted_ms * 1e3
            )

    def observe_period(
        self, batch: list[ScheduledRequest], resolved_s: float, after_idle: bool
    ) -> None:
        """A step's period: from the previous step's tokens reaching the host to its own
        (`resolved_s`, perf_counter seconds), which is what a step costs in throughput under
        the synchronous and the overlapped loop alike. Steps are processed in launch order.
        For a decode-only step, not after an idle engine or a prefill step, the cost model
        records it by (decoding requests, K): as steady when the step before had the same K,
        else, less the steady step after it, as the cost of the switch (the first step at a
        new K pays one-off costs: a drafter catch-up, a host wait the overlap would have
        hidden). Not as steady: a plain step followed by a drafting one, which the overlap
        loop may resolve before launching the next step (when the drafter reads committed
        tokens on the host), so that its period misses host work that lands in the next
        one's. The policy's trace gets the period and its use."""
        switch, self._last_switch = self._last_switch, None
        decoding = [s for s in batch if s.decoding]
        shape = (len(decoding), max(len(s.drafts) for s in decoding)) if decoding else None
        prev_shape, prev_s = self._last_shape, self._last_resolved_s
        only_decodes = decoding and len(decoding) == len(batch)
        self._last_shape = shape if only_decodes else None
        self._last_resolved_s = resolved_s
        if shape is None:
            return
        decision, next_k = self.policy.trace.processed(*shape)
        if prev_s is None or resolved_s <= prev_s or after_idle:
            return
        period_ms = (resolved_s - prev_s) * 1e3
        used = ""
        if only_decodes and prev_shape is not None:
            n, k = shape
            if k != prev_shape[1]:
                used = "switch"
                self._last_switch = (prev_shape[1], k, period_ms)
            elif k == 0 and next_k:
                used = "before_switch"
            else:
                used = "steady"
                self.policy.trace.observed_goodput = self._last_committed / period_ms * 1e3
                if self.cost is not None:
                    self.cost.observe(n, k, period_ms)
                    if switch is not None:  # the step before was the switch to this K
                        self.cost.observe_switch(n, switch[0], k, switch[2], period_ms)
        if decision is not None:
            decision.observed_ms, decision.recorded = period_ms, used

    def stats(self) -> dict:
        """Speculation figures for metrics: decisions, acceptance, goodput."""
        trace = self.policy.trace
        return {
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
        }
