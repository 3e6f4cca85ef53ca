"""A rank's place in a tensor-parallel group, its collectives, and how a dimension splits.

The group is passed in (NCCL on CUDA, gloo on the CPU), never looked up from a process
global: a model built for a `TensorParallel` reduces over that group and no other. At size 1
every collective is a no-op, so single-rank code paths stay what they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.core.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def split_evenly(total: int, parts: int, what: str) -> int:
    """total / parts; a ConfigError naming `what` when it does not divide."""
    if total % parts:
        raise ConfigError(
            f"{what} {total} is not divisible by tensor_parallel_size {parts}: "
            "choose a tensor_parallel_size that divides it"
        )
    return total // parts


@dataclass(frozen=True)
class TensorSlice:
    """The part of a checkpoint tensor one rank holds: `length` entries from `start` along
    `dim`, of the `full` entries the tensor has there."""

    dim: int
    start: int
    length: int
    full: int

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of a tensor of the full size (a view)."""
        return tensor.narrow(self.dim, self.start, self.length)


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of a tensor-parallel group of `size` ranks communicating over `group` (a
    torch.distributed ProcessGroup of exactly those ranks; None only at size 1)."""

    rank: int = 0
    size: int = 1
    group: ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"tensor-parallel rank {self.rank} is outside a group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ConfigError("a tensor-parallel group of more than one rank needs its group")

    @classmethod
    def of(cls, group: ProcessGroup) -> TensorParallel:
        """This process's place in `group` (an initialized torch.distributed group)."""
        import torch.distributed as dist

        size = dist.get_world_size(group)
        return cls(dist.get_rank(group), size, group if size > 1 else None)

    def split(self, total: int, what: str) -> int:
        """This rank's even share of `total` (e.g. heads); ConfigError when uneven."""
        return split_evenly(total, self.size, what)

    def even_slice(self, dim: int, total: int, what: str) -> TensorSlice | None:
        """This rank's contiguous share of `total` entries along `dim` (None at size 1: the
        whole tensor); ConfigError naming `what` when `total` does not divide."""
        if self.size == 1:
            return None
        part = self.split(total, what)
        return TensorSlice(dim, self.rank * part, part, total)

    def padded_rows(self, total: int) -> int:
        """Rows each rank holds of `total` split in contiguous shards of equal size, the
        last one padded (a vocabulary that the size does not divide)."""
        return -(-total // self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group, in place where `x` is contiguous (returned); `x`
        itself at size 1."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        if not x.is_contiguous():
            x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in rank order (`x` at size 1)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE_RANK = TensorParallel()  # the unsharded model: every collective a no-op
