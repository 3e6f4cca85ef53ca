"""RMSNorm with the numerics of the Hugging Face Llama implementation (fp32 statistics)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / rms(x), computed in fp32 and cast back before the weight multiply.

    `forward(x)` returns the normed tensor. `forward(x, residual)` first adds the residual
    stream (`x + residual`, rounded to the activation dtype as a plain add would) and returns
    (normed sum, sum): the decoder layers carry (hidden, residual) pairs so that the fused
    Triton subclass can do the add and the norm in one kernel with the same rounding.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            total = x + residual
            return self._norm(total), total
        return self._norm(x)

    def norm_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """The norm of x [T, H] written into `out` [T, H] (e.g. half of a [T, 2H] buffer)."""
        out.copy_(self._norm(x))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
