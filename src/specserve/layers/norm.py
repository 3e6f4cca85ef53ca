"""RMSNorm with the numerics of the Hugging Face Llama implementation (fp32 statistics)."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / rms(x), computed in fp32 and cast back before the weight multiply."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
