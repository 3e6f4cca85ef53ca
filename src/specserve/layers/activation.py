"""The gated SiLU MLP of Llama-family models: with separate gate/up projections (Hugging
Face names, used by the EAGLE-3 head's public layout) or with both in one GEMM."""

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers.linear import MergedLinear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with Hugging Face parameter names."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MergedGatedMLP(nn.Module):
    """The same MLP with gate and up stacked in one weight (`gate_up_proj`): one GEMM reads
    both, which at decode batch sizes saves a weight-streaming kernel per layer."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = MergedLinear(
            hidden, {"gate_proj": intermediate, "up_proj": intermediate}, bias=False
        )
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, defer_reduce: bool = False) -> torch.Tensor:
        """defer_reduce: the caller feeds the output to an RMSNorm with residual, which
        accepts what the Triton subclass may return instead of a tensor (triton_ops.py);
        here it changes nothing."""
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
