"""A step between its launch and its processing (engine/step_loop.py), and the device
timeline of recent steps."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from specserve.engine.scheduler import ScheduledRequest
from specserve.runtime.inflight import InflightStep
from specserve.runtime.model_runner import StepInput, num_drafts
from specserve.runtime.sampled_tokens import SampledTokens, StepResult


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
    result: StepResult | None = None  # set when resolved
    resolved_s: float = 0.0  # perf_counter when its tokens reached the host
    consumed: set[int] = field(default_factory=set)  # see InflightStep.consumed

    def inflight(self) -> InflightStep:
        """This step as the next one reads it on the device, before it is resolved."""
        sampled = self.step_input.sampled
        rows = {id(s.request): r for r, s in enumerate(sampled)}
        feature_rows = {}
        if self.features is not None:  # queued on the requests only when resolved
            # Every scheduled request's rows, a prefill chunk that drew no token included:
            # the next step may catch its drafter up on them.
            firsts = self.step_input.first_rows
            feature_rows = {id(s.request): (first, s.num_tokens + num_drafts(s))
                            for s, first in zip(self.batch, firsts)}  # fmt: skip
        return InflightStep(
            self.sampled.tokens, self.sampled.accept_len, rows, [num_drafts(s) for s in sampled],
            self.features, feature_rows, self.consumed,
        )  # fmt: skip


@dataclass
class StepTimes:
    """Device timeline of recent steps (CUDA events): each step's device span and the idle
    gap between the end of one step's device work and the start of the next one's."""

    step_ms: deque = field(default_factory=lambda: deque(maxlen=4096))
    gap_ms: deque = field(default_factory=lambda: deque(maxlen=4096))

    def clear(self) -> None:
        self.step_ms.clear()
        self.gap_ms.clear()
