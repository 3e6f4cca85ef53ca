"""A host-bound engine's clock for the serving simulator (serving_sim.py: `ServingRegime.clock`):
SmolLM2-135M with its EAGLE-3 head served on an H100, as session 58 measured it through the
server (64 hand-written chat questions, closed loop at 1, 8 and 64 clients; docs/performance.md,
"The default model on chat prompts"). Its steps are launches and host work, not weights: a
plain step of 64 requests takes ~1.5 ms and a K=3 step ~3.6 (about flat in K), so plain
decoding wins at 64 by about 4% at its acceptance, drafting at 1 and 8 by 1.4-1.5x and 1.1x.

Unlike the 8B clock, what a step costs depends on the step before it and on the drafter's
state, as on the device: the first drafting step after plain ones waits for their tokens
and has the drafter catch up eagerly on what it missed (passes outside the captured graphs:
the H100's cost model measured 5.6-6.9 ms at 64 requests for that way back), the drafter
takes every prompt beside prefill while it is kept up, and a goodput decision deliberated
costs the host its time (the H200's: `H200_DELIBERATION`)."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.speculative.cost_model import CurveModel, StepCostModel
from tests.support.policy_sim_engines import H200_DELIBERATION, SMALL_HEAD, SMALL_TARGET


@dataclass(frozen=True)
class HostBoundClock:
    """Whole-step wall times (ms) by decode rows: `plain` at K=0, `draft` at K=3 (other K
    scaled by `per_k`), each step carrying prefill `prefill_ms` more plus `prefill_per_token`
    a prompt token, and `draft_prefill_ms` more where the drafter is kept up beside it (it
    takes the prompt) or drafts. The first drafting step after plain ones waits
    `stall_share` of a plain step for their tokens and catches the drafter up eagerly:
    `eager_ms` plus `eager_per_token` a token it missed (the H100's cost model read that
    way back at 5.6-6.9 ms at 64 requests, and run 5 on the H200 3.5-6.5 ms at one); any
    other catch-up beyond a ride-along (more than `ride_along` tokens a request: a cold
    prompt) is an eager pass, `eager_pass_ms` plus the tokens."""

    plain: tuple = ((1, 0.58), (8, 0.72), (64, 1.50), (256, 4.0))
    draft: tuple = ((1, 0.88), (8, 1.42), (64, 3.60), (256, 11.0))
    per_k: float = 0.03  # a K=k step is draft(n) x (1 - per_k x (3 - k))
    prefill_ms: float = 0.5
    prefill_per_token: float = 0.002
    draft_prefill_ms: float = 0.35
    awake_prefill_ms: float | None = None  # (a plain step kept up: draft_prefill_ms if None)
    ride_along: int = 2
    eager_ms: float = 4.0
    eager_pass_ms: float = 0.5
    eager_per_token: float = 0.001
    stall_share: float = 0.3
    deliberation_ms: float = H200_DELIBERATION["deliberation_ms"]
    deliberation_per_req_ms: float = H200_DELIBERATION["deliberation_per_req_ms"]

    def step_ms(
        self,
        rows: int,
        k: int,
        prefill_tokens: int,
        catch_up_tokens: int,
        kept_up: bool,
        after_plain: bool,
        deliberated: bool,
    ) -> float:
        """One step: `rows` decode rows at K=k beside `prefill_tokens` of prompt chunks; the
        drafter catches up on `catch_up_tokens` beyond its passes' own (`kept_up`: it is
        kept up, so it takes the prompts too); `after_plain`: the step before was plain (a
        drafting step then waits for it); `deliberated`: the goodput policy deliberated."""
        if k:
            ms = CurveModel(dict(self.draft))(rows) * (1.0 - self.per_k * (3 - k))
        else:
            ms = CurveModel(dict(self.plain))(rows) if rows else 0.0
        if prefill_tokens:
            ms += self.prefill_ms + self.prefill_per_token * prefill_tokens
            if k:
                ms += self.draft_prefill_ms
            elif kept_up:
                awake = self.awake_prefill_ms
                ms += self.draft_prefill_ms if awake is None else awake
        if k and after_plain:  # the wait for the plain step's tokens, the eager catch-up
            ms += self.stall_share * CurveModel(dict(self.plain))(rows) + self.eager_ms
            ms += self.eager_per_token * catch_up_tokens
        elif catch_up_tokens > self.ride_along * rows + (prefill_tokens if kept_up else 0):
            ms += self.eager_pass_ms + self.eager_per_token * catch_up_tokens
        if deliberated:
            ms += self.deliberation_ms + self.deliberation_per_req_ms * rows
        return ms

    def upkeep_ms(self, k: int) -> float:
        """The host time the step loop measures for the drafter's upkeep in a step carrying
        prefill with the drafter kept up (`DrafterUpkeep`): what the step costs beyond
        its prefill for it, `draft_prefill_ms` drafting at K=k > 0, `awake_prefill_ms` plain
        (`draft_prefill_ms` where that is None)."""
        if k or self.awake_prefill_ms is None:
            return self.draft_prefill_ms
        return self.awake_prefill_ms

    @staticmethod
    def seeds() -> StepCostModel:
        """What start-up measures on this engine: padded graphs' device time alone."""
        return StepCostModel(CurveModel(SMALL_TARGET), CurveModel(SMALL_HEAD), padded=True)


SMOLLM2_H100 = HostBoundClock()

# The same model through the server on another H100 (session 60, machine B), from goodput's
# per-step record at 64 clients (`--speculative-trace-file`, median periods): decode-only
# steps 1.90 ms plain dormant, 1.98 awake, 3.71 at K=2 and 4.16 at K=3 (every K within 1%
# of the others in tokens a request per ms); beside prefill a dormant plain step 1.89, a
# plain one with the drafter kept up 3.39 (its eager pass over each new prompt), a K=3 one
# 4.93 and a K=2 one 4.42. The way back to drafting costs about 1 ms (a plain step before
# a drafting one 3.62 against 2.65; the drafting step no dearer than a steady one), not
# the 4-7 of session 58's machine. Plain decoding with the drafter dormant is best here by
# about 8% (off 30,726 tok/s against fixed K=3's 28,356 in that round).
SMOLLM2_H100_B = HostBoundClock(
    plain=((1, 0.58), (8, 0.72), (32, 1.15), (64, 1.90), (256, 4.8)),
    draft=((1, 0.88), (8, 1.42), (32, 2.55), (64, 4.16), (256, 12.5)),
    per_k=0.1,
    prefill_ms=0.0,
    prefill_per_token=0.0,
    draft_prefill_ms=0.75,
    awake_prefill_ms=1.45,
    eager_ms=0.5,
    stall_share=0.15,
)
