"""Speculation policies: each step, a draft length (0..K_max) for every decoding request.

- off: never speculate (the plain decode path runs);
- fixed: K_max every step;
- schedule: a user table from batch size to K (the form other servers offer);
- goodput: maximize expected committed tokens per second of the step under a measured cost
  model (whole-step periods by batch bucket and K, one-off costs of switching K) and
  per-request acceptance estimates.

Every policy's decisions go to a bounded trace (`PolicyTrace.recent`, `dump()`), joined by
the speculator with each step's measured period once the step is processed.
"""

from __future__ import annotations

from specserve.speculative.goodput_policy import GoodputPolicy
from specserve.speculative.policy_base import (
    NO_LOAD,
    FixedPolicy,
    OffPolicy,
    PerRequestPolicy,
    SchedulePolicy,
    SpeculationPolicy,
    StepLoad,
)
from specserve.speculative.policy_trace import Decision, PolicyTrace

__all__ = [
    "POLICIES",
    "Decision",
    "PolicyTrace",
    "SpeculationPolicy",
    "OffPolicy",
    "FixedPolicy",
    "SchedulePolicy",
    "PerRequestPolicy",
    "GoodputPolicy",
    "StepLoad",
    "NO_LOAD",
]
POLICIES = ("off", "fixed", "schedule", "goodput")
