"""The gated SiLU MLP of Llama-family models."""

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with Hugging Face parameter names."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
