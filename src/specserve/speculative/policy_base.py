"""The speculation policy interface, and the policies whose draft lengths need no
measurements: off, fixed, a user schedule by batch size, and a function of the request
(tests). policy.py lists every policy; goodput_policy.py holds the measured one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from specserve.core.config_sections import parse_schedule
from specserve.core.request import Request
from specserve.speculative.policy_trace import PolicyTrace


@dataclass(frozen=True)
class StepLoad:
    """What else a step carries, as the scheduler hands it to the policy after it has
    scheduled every committed token (decodes, prefill chunks, admissions): speculation takes
    what is left, never a share of prefill's budget.

    prefill_tokens: prefill tokens in the step. draft_budget: the most draft tokens the step
    may add (None: no bound). waiting: requests left waiting for budget or pages after the
    step's admissions (not those waiting for a sequence slot, which drafts do not take).
    after_idle: the first step with decoding requests since the scheduler had none running
    (new work on an idle server). prefill_per_token: the prompt tokens per generated token
    of the requests finished lately: in a server taking new work each committed token brings
    that much prefill into the steps after it (a request finished admits the next; a closed
    loop prefills once per request whatever K is: K changes how much decode work each
    prefill token rides with). occupancy: the share of the server's room (sequence slots,
    or the KV cache for requests of the finished ones' mean length) the running requests
    take; a finished request admits the next only in a full server, while below its room
    arrivals are admitted whatever K does."""

    prefill_tokens: int = 0
    draft_budget: int | None = None
    prefill_per_token: float = 0.0
    waiting: int = 0
    after_idle: bool = False
    occupancy: float = 1.0

    def k_cap(self, n: int, max_draft_len: int) -> int:
        """The largest K up to `max_draft_len` that every one of n decoding requests can
        draft within the budget."""
        if self.draft_budget is None or n == 0:
            return max_draft_len
        return max(0, min(max_draft_len, self.draft_budget // n))


NO_LOAD = StepLoad()


class SpeculationPolicy(ABC):
    """Chooses draft lengths for the decoding requests of a step."""

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.trace = PolicyTrace()
        self.predicted_tokens = 0.0
        self.predicted_ms = 0.0

    @abstractmethod
    def choose(self, reqs: list[Request], load: StepLoad = NO_LOAD) -> list[int]:
        """Draft lengths for `reqs`, within `load.draft_budget`; `load` says what else the
        step carries."""

    def reads_caps(self, load: StepLoad) -> bool:
        """Whether the next `choose` (with `load`) reads its requests' `max_useful_drafts`:
        the scheduler sets them only then (a pass over every decoding request of the step,
        whose host time a fast model's step feels)."""
        return True

    def _decided(self, draft_lens: list[int], **expected) -> list[int]:
        """Trace the decision; returns `draft_lens`."""
        if draft_lens:
            self.trace.decided(len(draft_lens), max(draft_lens), **expected)
        else:
            self.trace.no_decode()
        return draft_lens


class OffPolicy(SpeculationPolicy):
    """K=0 for every request, every step (plain decoding)."""

    def choose(self, reqs, load=NO_LOAD):
        return self._decided([0] * len(reqs))


class FixedPolicy(SpeculationPolicy):
    """K_max for every request, every step the budget allows (else as many as it does)."""

    def choose(self, reqs, load=NO_LOAD):
        return self._decided([load.k_cap(len(reqs), self.k_max)] * len(reqs))


class SchedulePolicy(SpeculationPolicy):
    """`table` like "1:4,16:2,64:0": from batch size 1 use K=4, from 16 K=2, from 64 off."""

    def __init__(self, k_max: int, table: str):
        super().__init__(k_max)
        self.table = parse_schedule(table, k_max)

    def choose(self, reqs, load=NO_LOAD):
        k = 0
        for min_batch, table_k in self.table:
            if len(reqs) >= min_batch:
                k = table_k
        return self._decided([min(k, load.k_cap(len(reqs), k))] * len(reqs))


class PerRequestPolicy(SpeculationPolicy):
    """Draft lengths from a function of the request (tests force arbitrary switching)."""

    def __init__(self, k_max: int, fn: Callable[[Request], int]):
        super().__init__(k_max)
        self.fn = fn

    def choose(self, reqs, load=NO_LOAD):
        return self._decided([self.fn(r) for r in reqs])
