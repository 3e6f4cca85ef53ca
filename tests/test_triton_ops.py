"""Fused Triton ops and the whole Triton fast path on the GPU (the CPU interpreter runs the
same checks through test_triton_attention.py)."""

from __future__ import annotations

import pytest
import torch

from tests.model_cases import model_error
from tests.triton_cases import (
    add_rms_norm_error,
    rms_norm_error,
    rotary_error,
    silu_and_mul_error,
)

pytestmark = pytest.mark.gpu
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _ops():
    from specserve.layers import triton_ops

    return triton_ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fused_ops_match_modules(dtype):
    ops = _ops()
    assert rms_norm_error(ops, dtype, "cuda", rows=33, dim=4096) < TOL[dtype]
    assert add_rms_norm_error(ops, dtype, "cuda", rows=33, dim=4096) < TOL[dtype]
    assert rotary_error(ops, dtype, "cuda", tokens=65, q_heads=32, k_heads=8, head_dim=128) < (
        TOL[dtype]
    )
    assert silu_and_mul_error(ops, dtype, "cuda", rows=17, dim=14336) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_model_with_triton_path_matches_torch(dtype, page_size):
    from specserve.layers.attention.triton_attn import TritonAttentionBackend

    err = model_error(TritonAttentionBackend(), dtype, "cuda", page_size, fused_ops=_ops())
    assert err < 3 * TOL[dtype], err
