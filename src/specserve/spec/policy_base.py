"""The speculation policy interface, and the policies whose draft lengths need no
measurements: off, fixed, a user schedule by batch size, and a function of the request
(tests). policy.py lists every policy; goodput_policy.py holds the measured one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from specserve.engine.request import Request
from specserve.spec.policy_trace import PolicyTrace


class SpeculationPolicy(ABC):
    """Chooses draft lengths for the decoding requests of a step."""

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.trace = PolicyTrace()
        self.predicted_tokens = 0.0
        self.predicted_ms = 0.0

    @abstractmethod
    def choose(self, reqs: list[Request], extra_tokens: int = 0) -> list[int]:
        """Draft lengths for `reqs`; `extra_tokens` counts prefill tokens sharing the step."""

    def _decided(self, ks: list[int], **expected) -> list[int]:
        """Trace the decision; returns `ks`."""
        if ks:
            self.trace.decided(len(ks), max(ks), **expected)
        else:
            self.trace.no_decode()
        return ks


class OffPolicy(SpeculationPolicy):
    """K=0 for every request, every step (plain decoding)."""

    def choose(self, reqs, extra_tokens=0):
        return self._decided([0] * len(reqs))


class FixedPolicy(SpeculationPolicy):
    """K_max for every request, every step."""

    def choose(self, reqs, extra_tokens=0):
        return self._decided([self.k_max] * len(reqs))


class SchedulePolicy(SpeculationPolicy):
    """`table` like "1:4,16:2,64:0": from batch size 1 use K=4, from 16 K=2, from 64 off."""

    def __init__(self, k_max: int, table: str):
        super().__init__(k_max)
        try:
            pairs = sorted((int(b), int(k)) for b, k in (e.split(":") for e in table.split(",")))
        except ValueError:
            raise ValueError(
                f"speculative schedule {table!r} must look like '1:4,16:2,64:0' "
                "(batch size:draft length, comma separated)"
            ) from None
        self.table = [(b, min(k, k_max)) for b, k in pairs]

    def choose(self, reqs, extra_tokens=0):
        k = 0
        for min_batch, table_k in self.table:
            if len(reqs) >= min_batch:
                k = table_k
        return self._decided([k] * len(reqs))


class PerRequestPolicy(SpeculationPolicy):
    """Draft lengths from a function of the request (tests force arbitrary switching)."""

    def __init__(self, k_max: int, fn: Callable[[Request], int]):
        super().__init__(k_max)
        self.fn = fn

    def choose(self, reqs, extra_tokens=0):
        return self._decided([self.fn(r) for r in reqs])
