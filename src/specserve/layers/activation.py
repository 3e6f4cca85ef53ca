"""The gated SiLU MLP of Llama-family models: with separate gate/up projections (Hugging
Face names, used by the EAGLE-3 head's public layout) or with both in one GEMM."""

import torch
import torch.nn.functional as F
from torch import nn

from specserve.core.parallel import SINGLE_RANK, TensorParallel
from specserve.layers.linear import MergedLinear
from specserve.layers.parallel import row_parallel_linear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with Hugging Face parameter names. Under tensor
    parallelism (`tp`) a rank holds its columns of gate and up and those input columns of
    down_proj (their `weight_slice`s), and the ranks' outputs are summed."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel = SINGLE_RANK):
        super().__init__()
        self.tp = tp
        part = tp.even_slice(0, intermediate, "intermediate_size")
        local = intermediate if part is None else part.length
        self.gate_proj = nn.Linear(hidden, local, bias=False)
        self.up_proj = nn.Linear(hidden, local, bias=False)
        if part is not None:
            self.gate_proj.weight_slice = self.up_proj.weight_slice = part
        self.down_proj = row_parallel_linear(intermediate, hidden, tp, "intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class MergedGatedMLP(nn.Module):
    """The same MLP with gate and up stacked in one weight (`gate_up_proj`): one GEMM reads
    both, which at decode batch sizes saves a weight-streaming kernel per layer.

    Under tensor parallelism (`tp`) a rank holds the same columns of gate and up (its
    `intermediate` of them, both halves together: SiLU-and-mul stays local) and those input
    columns of down_proj (row-parallel); the ranks' outputs are summed."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel = SINGLE_RANK):
        super().__init__()
        self.tp = tp
        part = tp.even_slice(0, intermediate, "intermediate_size")
        self.intermediate = intermediate if part is None else part.length
        self.gate_up_proj = MergedLinear(
            hidden,
            {"gate_proj": self.intermediate, "up_proj": self.intermediate},
            bias=False,
            slices={"gate_proj": part, "up_proj": part},
        )
        self.down_proj = row_parallel_linear(intermediate, hidden, tp, "intermediate_size")

    def forward(self, x: torch.Tensor, defer_reduce: bool = False) -> torch.Tensor:
        """defer_reduce: the caller feeds the output to an RMSNorm with residual, which
        accepts what the Triton subclass may return instead of a tensor (triton_ops.py).
        Over several ranks the output is all-reduced, from each rank's reduced sum."""
        if self.tp.size == 1:
            return self.partial(x, defer_reduce)
        return self.tp.all_reduce(self.partial(x, defer_reduce=False))

    def partial(self, x: torch.Tensor, defer_reduce: bool = False) -> torch.Tensor:
        """This rank's share of the output (all of it at size 1); defer_reduce as in
        `forward` (changes nothing here)."""
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
