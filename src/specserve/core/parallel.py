"""A rank's place in a tensor-parallel group (placeholder until the sharded model lands)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None


SINGLE = TensorParallel()
