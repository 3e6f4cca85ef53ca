"""A step between its launch and its processing (engine/step_loop.py), and the device
timeline of recent steps."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from specserve.core.batch import ScheduledRequest
from specserve.runtime.inflight import InflightStep
from specserve.runtime.sampled_tokens import SampledTokens, StepResult
from specserve.runtime.step_input import StepInput


@dataclass
class LaunchedStep:
    """One step between its launch and its processing."""

    batch: list[ScheduledRequest]
    step_input: StepInput
    sampled: SampledTokens
    features: torch.Tensor | None  # the drafter's inputs from this step (taken at launch)
    speculative: bool  # a request drafted: the next positions need the accept lengths
    draft_ms: float
    host_ms: float  # host time of prepare + forward + sample (the device time on the CPU)
    preemptions: list[int]  # each scheduled request's preemption count at launch
    events: tuple | None = None  # CUDA events: start, forward start, end of device work
    after_idle: bool = False  # nothing ran just before it (no gap to measure)
    kept_drafter: bool = False  # the drafter was kept up in it (not dormant, not off)
    waited: bool = False  # launched after waiting for the step before it (its tokens)
    # host ms of the drafter's upkeep beside prefill (its passes over the new prompt pairs,
    # and its ride-alongs in a plain step); None where it was not kept up or no prefill
    upkeep_ms: float | None = None
    wait_ms: float = 0.0  # how long the host waited for its tokens (set when resolved)
    result: StepResult | None = None  # set when resolved
    resolved_s: float = 0.0  # perf_counter when its tokens reached the host
    device_ms: float | None = None  # its device span (CUDA events), once processed
    consumed: set[int] = field(default_factory=set)  # see InflightStep.consumed

    def inflight(self) -> InflightStep:
        """This step as the next one reads it on the device, before it is resolved."""
        sampled = self.step_input.sampled
        rows = {id(s.request): r for r, s in enumerate(sampled)}
        return InflightStep(
            self.sampled.tokens,
            self.sampled.accept_len,
            rows,
            [s.drafted for s in sampled],
            self.batch,
            self.consumed,
        )


@dataclass
class StepTimes:
    """Timeline of recent steps: each step's device span, the part of it from the target's
    forward on (`target_ms`; the rest is drafting, and in prefill steps the drafter's
    prompt catch-up after the forward counts in it), and the idle gap between the end of
    one step's device work and the start of the next one's (CUDA events), and how long the
    host blocked for each step's tokens (`wait_ms`, any device: ~0 when the host is the
    bottleneck, the device's lead when the device is)."""

    step_ms: deque = field(default_factory=lambda: deque(maxlen=4096))
    target_ms: deque = field(default_factory=lambda: deque(maxlen=4096))
    gap_ms: deque = field(default_factory=lambda: deque(maxlen=4096))
    wait_ms: deque = field(default_factory=lambda: deque(maxlen=4096))

    def clear(self) -> None:
        self.step_ms.clear()
        self.target_ms.clear()
        self.gap_ms.clear()
        self.wait_ms.clear()


def step_kind(batch: list[ScheduledRequest]) -> str:
    """How the loop's statistics name a step: "decode" (every row decodes or verifies) or
    "prefill" (a prompt chunk rides along), and its K (the longest draft verified): "decode
    K=0", "prefill K=1". Steps carrying prefill run eagerly and cost what their chunks cost,
    so a step time by K alone mixes two kinds of work in the load's proportions."""
    k = max((s.draft_len for s in batch), default=0)
    return f"{'decode' if all(s.decoding for s in batch) else 'prefill'} K={k}"
