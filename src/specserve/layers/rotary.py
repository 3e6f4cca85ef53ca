"""Rotary position embedding (rotate-half layout), with optional llama3 frequency scaling
(from its parameters, or as a GGUF's per-frequency factors)."""

from __future__ import annotations

import math

import torch
from torch import nn

from specserve.core.model_config import RopeFreqFactors, RopeScaling


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | RopeFreqFactors | None
) -> torch.Tensor:
    """The fp32 inverse frequencies, llama3-scaled when `scaling` is given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, RopeFreqFactors):
        return inv_freq / torch.tensor(scaling.factors, dtype=torch.float32)
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to q and k given absolute token positions.

    cos/sin for every position up to `max_positions` are precomputed once (`materialize`).
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling=None):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.max_positions = max_positions
        self.scaling = scaling
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def materialize(self, device: torch.device) -> None:
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling)
        t = torch.arange(self.max_positions, dtype=torch.int64).float()
        freqs = t[:, None] * inv_freq[None, :]
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.head_dim // 2
        cos_sin = self.cos_sin[positions]
        cos = cos_sin[:, None, :half]
        sin = cos_sin[:, None, half:]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cos = torch.cat([cos, cos], dim=-1).to(x.dtype)
    sin = torch.cat([sin, sin], dim=-1).to(x.dtype)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
