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
        """Time the target by tokens per step and the drafter by batch on this machine."""
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
        return StepCostModel(target, drafter)

    def observe(
        self,
        batch: list[ScheduledRequest],
        committed: dict[int, int],
        draft_ms: float,
        target_ms: float,
    ) -> None:
        """After a step: acceptance per request, cost-model refinement, decision trace."""
        decoding = [s for s in batch if s.decoding]
        for s in decoding:
            if s.drafts:
                self.acceptance.update(
                    s.request.request_id, len(s.drafts), committed.get(id(s), 1) - 1
                )
        lens = [len(s.drafts) for s in decoding]
        self.policy.trace.record(lens)
        if self.cost is not None:
            self.cost.target.observe(sum(s.num_tokens + len(s.drafts) for s in batch), target_ms)
            if self.cost.drafter is not None and any(lens):
                self.cost.drafter.observe(sum(1 for k in lens if k), draft_ms / max(lens))
        total_ms = draft_ms + target_ms
        if total_ms > 0:
            self.policy.trace.observed_goodput = sum(committed.values()) / total_ms * 1e3
        if self.policy.predicted_ms > 0:
            self.policy.trace.predicted_goodput = (
                self.policy.predicted_tokens / self.policy.predicted_ms * 1e3
            )

    def stats(self) -> dict:
        """Speculation figures for metrics: decisions, acceptance, goodput."""
        trace = self.policy.trace
        return {
            "spec_policy": type(self.policy).__name__,
            "spec_simulated_acceptance": self.simulate_rate is not None,
            "spec_steps_by_draft_len": list(trace.steps_by_draft_len),
            "spec_last_draft_lens": list(trace.last_draft_lens),
            "spec_predicted_goodput": trace.predicted_goodput,
            "spec_observed_goodput": trace.observed_goodput,
            "spec_position_drafted": list(self.acceptance.position_drafted),
            "spec_position_accepted": list(self.acceptance.position_accepted),
        }
