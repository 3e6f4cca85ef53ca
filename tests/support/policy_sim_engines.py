"""The simulated engines of policy_sim.py: true step costs (host and device work, what a
switch of K costs and where it lands) and the curves their start-up measures."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specserve.speculative.cost_model import CurveModel, StepCostModel

# shared/DESIGN.md: H200, Llama-3.1-8B shape, step ms by tokens; an EAGLE-3 head pass by batch.
H200_8B = {1: 4.22, 16: 4.44, 64: 4.60, 128: 6.11, 256: 6.91, 512: 12.06, 1024: 22.94, 2048: 45.98}
HEAD_8B = {1: 0.20, 64: 0.22, 256: 0.30, 1024: 0.60}
# SmolLM2-135M: a ~0.5 ms graph replay that hardly grows with tokens; a tiny head.
SMALL_TARGET = {1: 0.45, 8: 0.46, 32: 0.48, 64: 0.50, 256: 0.70, 1024: 1.80}
SMALL_HEAD = {1: 0.09, 64: 0.10, 256: 0.15}


@dataclass(frozen=True)
class Regime:
    """True step costs of a simulated engine (ms) and the curves its start-up measures."""

    name: str
    target: dict[int, float]  # device: the target's forward by tokens (also the seed)
    drafter: dict[int, float]  # device: one head pass by batch (also the seed)
    host0: float  # host ms of a plain step, plus host_per_req0 per request
    host_per_req0: float
    host_spec: float  # host ms of a speculative step, plus host_per_k per draft ...
    host_per_k: float
    host_per_req: float  # ... and this (plus host_per_req_k per draft) per request
    host_per_req_k: float
    stall_share: float = 0.6  # switching 0 -> K: a serial wait, this share of a plain step
    down_share: float = 0.5  # switching K -> 0: a plain step not overlapped
    eager_ms: float = 2.0  # an eager drafter catch-up (past a few plain steps, or a prompt)
    eager_after: int = 4  # plain steps a captured catch-up graph still covers
    early_share: float = 0.4  # a plain step before a drafting one resolves this much early
    prefill_ms: float = 2.0
    steady: Callable[[int, int], float] | None = None  # replaces max(host, device)
    # The next step is launched before this one resolves (overlap), so the host work of that
    # launch lands in this step's period: this share of how much more a step at the next K
    # costs than one at this K, and (catch_up_before) the drafter's eager catch-up.
    next_launch_share: float = 0.0
    catch_up_before: bool = False
    prompt_catch_up: bool = True  # a request's first drafting step catches up on its prompt
    # The host's time for a goodput decision deliberated (not repeated from a settled one):
    # this plus per request, in the host's part of the step (where the host paces the step,
    # in its period). Fixed K and plain decoding deliberate nothing.
    deliberation_ms: float = 0.0
    deliberation_per_req_ms: float = 0.0

    def device(self, n: int, k: int) -> float:
        ms = CurveModel(self.target)(n * (k + 1))
        return ms + k * CurveModel(self.drafter)(n) if k else ms

    def host(self, n: int, k: int) -> float:
        if not k:
            return self.host0 + self.host_per_req0 * n
        return (
            self.host_spec + self.host_per_k * k + (self.host_per_req + self.host_per_req_k * k) * n
        )

    def period(self, n: int, k: int, deliberated: bool = False) -> float:
        if self.steady is not None:
            return self.steady(n, k)
        host = self.host(n, k)
        if deliberated:
            host += self.deliberation_ms + self.deliberation_per_req_ms * n
        return max(host, self.device(n, k))

    @staticmethod
    def steady_only(steady: Callable[[int, int], float]) -> Regime:
        """Periods from `steady` alone: no switch penalty, no early resolve, no catch-up."""
        return Regime(
            "steady",
            {1: 1.0},
            {1: 1.0},
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0,
            0.0,
            0.0,
            steady,
        )

    def seeds(self) -> StepCostModel:
        """What start-up measures: device work alone, no host work; padded (CUDA graphs)."""
        return StepCostModel(CurveModel(self.target), CurveModel(self.drafter), padded=True)


# A goodput deliberation on the H200's host: ~0.03 ms at 8 requests more than a fixed K's
# decision (session 36: the schedule part 0.068-0.087 ms a step against 0.044-0.048, the
# default model, every step deliberated), ~60 us at 16 and ~150 at 64 (session 23)
H200_DELIBERATION = {"deliberation_ms": 0.03, "deliberation_per_req_ms": 0.0015}

# A ~1 ms host-bound step: at batch 1 a speculative step costs twice a plain one (K=3 wins
# by about 23% at real acceptance), at 64 plain decoding wins by about 30%.
SMALL = Regime(
    "small", SMALL_TARGET, SMALL_HEAD, 1.10, 0.012, 1.20, 0.25, 0.03, 0.01, **H200_DELIBERATION
)
# A 4 ms GPU-bound step: host work mostly hidden, speculation 2x at batch 1, 1.5x at 64, and
# a loss at 256 (verify of 1024 tokens).
LARGE = Regime("large", H200_8B, HEAD_8B, 1.0, 0.01, 1.3, 0.25, 0.03, 0.01, **H200_DELIBERATION)
# SmolLM2-135M + its EAGLE-3 head on the H200 as measured (gpu_default_model_run5_goodput_
# trace.json, in git history), host-bound throughout: steady periods at batch 1 of 0.975 ms
# plain and 1.82 ms at K=3 (about flat in K), at 8 of 1.08 and 2.19, at 64 of 1.92 and 5.2
# (plain decoding wins there by a few percent). The step before a change of K carries most of
# the change (its successor's launch ran before it resolved): a drafting step before a plain
# one is 0.6 ms short, a plain step before drafting 3.5-6.5 ms long (the drafter's eager
# catch-up after a long plain run); the first plain steps are 0.17 ms short.
MEASURED = Regime(
    "measured",
    SMALL_TARGET,
    SMALL_HEAD,
    0.96,
    0.015,
    1.70,
    0.02,
    0.03,
    0.008,
    stall_share=0.1,
    down_share=-0.35,
    eager_ms=3.5,
    early_share=0.0,
    next_launch_share=0.7,
    catch_up_before=True,
    prompt_catch_up=False,
    **H200_DELIBERATION,
)
