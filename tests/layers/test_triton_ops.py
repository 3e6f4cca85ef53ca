"""Fused Triton ops: the rotary + paged KV write kernel against the PyTorch path (rotary
module, then the reference KV write) and against the unfused Triton kernels, through the
CPU interpreter in a subprocess (fp16/fp32, GQA, odd slot mappings: skipped slots, padded
tokens on scratch page 0, a strided qkv); on a GPU (`-m gpu`) the fused ops at the
Llama-3.1-8B shape and the whole Triton fast path."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.support.model_cases import model_error
from tests.support.triton_cases import (
    add_rms_norm_error,
    rel_err,
    rms_norm_error,
    rotary_error,
    silu_and_mul_error,
)

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _ops():
    from specserve.layers import triton_ops

    return triton_ops


# ---- the fused rotary + KV write --------------------------------------------------------
def rotary_store_errors(
    ops,
    kernels,
    dtype,
    device,
    tokens=9,
    q_heads=6,
    kv_heads=2,
    head_dim=16,
    page_size=4,
    cache_dtype=None,
    strided=False,
    seed=0,
) -> dict[str, float]:
    """{"ref": error against rotary module + reference KV write, "unfused": largest absolute
    difference from the separate Triton rotary and KV-write kernels (0: bit-identical),
    "page0": largest change of page 0 outside slot 0}. Token 0 is skipped (slot -1), the
    last two are padding on slot 0 of page 0, the rest land on scattered pages."""
    from specserve.layers.attention.base import write_kv
    from specserve.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width + (24 if strided else 0), generator=gen)[:, :width]
    qkv = qkv.to(dtype=dtype, device=device)
    num_pages = 2 + -(-tokens // page_size) * 2
    real = tokens - 3
    slots = torch.randperm((num_pages - 1) * page_size, generator=gen)[:real] + page_size
    slots = torch.cat([torch.tensor([-1]), slots, torch.tensor([0, 0])]).to(device)
    positions = torch.randint(0, 256, (tokens,), generator=gen).to(device)
    rope = RotaryEmbedding(head_dim, 10000.0, 256)
    rope.materialize(torch.device(device))
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype=cache_dtype, device=device)
    v_cache = torch.randn(shape, generator=gen).to(dtype=cache_dtype, device=device)

    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k, v = (t.reshape(tokens, -1, head_dim) for t in (q, k, v))
    fk, fv = k_cache.clone(), v_cache.clone()
    q_fused = ops.rotary_store_kv(positions, qkv, rope.cos_sin, q_heads, kv_heads, fk, fv, slots)
    rq, rk = rope(positions, q, k)
    rk_cache, rv_cache = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    write_kv(rk[keep], v[keep], rk_cache, rv_cache, slots[keep])
    uk_cache, uv_cache = k_cache.clone(), v_cache.clone()
    uq, uk = ops.rotary(positions, q, k, rope.cos_sin)
    kernels.write_kv(uk, v, uk_cache, uv_cache, slots)

    def diff(a, b) -> float:
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0

    # pages 1..: the real tokens; slot 0 of page 0: the two padding tokens' writes race on
    # a GPU (stores of either may land last, chunk by chunk), so each element holds one of
    # theirs (the separate kernels' rotary, which the fused kernel matches bit for bit)
    pad_ok = all(
        ((cache[0, 0] == src[-2].to(cache_dtype)) | (cache[0, 0] == src[-1].to(cache_dtype)))
        .all()
        .item()
        for cache, src in ((fk, uk), (fv, v))
    )
    page0 = max(diff(fk[0, 1:], k_cache[0, 1:]), diff(fv[0, 1:], v_cache[0, 1:]), 0.0)
    return {
        "ref": max(
            rel_err(q_fused, rq), rel_err(fk[1:], rk_cache[1:]), rel_err(fv[1:], rv_cache[1:])
        ),
        "unfused": max(diff(q_fused, uq), diff(fk[1:], uk_cache[1:]), diff(fv[1:], uv_cache[1:])),
        "page0": page0 if pad_ok else float("inf"),
    }


CASES = {
    "gqa-fp16-page4": dict(dtype="float16"),
    "gqa-fp32-page4": dict(dtype="float32"),
    "gqa-fp16-page1-strided": dict(dtype="float16", page_size=1, strided=True),
    "mha-fp16-page16": dict(dtype="float16", q_heads=4, kv_heads=4, page_size=16, tokens=20),
    "odd-heads-fp32-page4": dict(dtype="float32", q_heads=9, kv_heads=3, head_dim=32),
    "fp16-into-fp32-cache": dict(dtype="float16", cache_dtype="float32"),
}


def run_cases() -> dict:
    from specserve.kernels.attention import triton_kernels as kernels
    from specserve.layers import triton_ops as ops

    results = {}
    for name, kw in CASES.items():
        kw = dict(kw)
        dtype = getattr(torch, kw.pop("dtype"))
        if "cache_dtype" in kw:
            kw["cache_dtype"] = getattr(torch, kw["cache_dtype"])
        try:
            results[name] = rotary_store_errors(ops, kernels, dtype, "cpu", seed=len(name), **kw)
        except Exception as e:  # reported per case by the test
            results[name] = f"{type(e).__name__}: {e}"
    try:
        results["norm-into-halves"] = norm_into_halves()
    except Exception as e:
        results["norm-into-halves"] = f"{type(e).__name__}: {e}"
    return results


def norm_into_halves() -> dict:
    """The EAGLE-3 head's layer input through the Triton norms (each writes its half of one
    [T, 2H] buffer) against the concatenation of the separate norms, and the torch norms."""
    from specserve.layers.norm import RMSNorm
    from specserve.layers.triton_ops import use_triton_ops

    gen = torch.Generator().manual_seed(7)
    norms = torch.nn.ModuleList(RMSNorm(48, 1e-6) for _ in "eh").to(torch.float16)
    for norm in norms:
        norm.weight.data = torch.randn(48, generator=gen).to(torch.float16)
    e, h = ((torch.randn(5, 48, generator=gen) * 3).to(torch.float16) for _ in "eh")
    ref = torch.cat([norms[0](e), norms[1](h)], dim=-1)
    use_triton_ops(norms)
    separate = torch.cat([norms[0](e), norms[1](h)], dim=-1)
    packed = torch.empty(5, 96, dtype=torch.float16)
    norms[0].norm_into(e, packed[:, :48])
    norms[1].norm_into(h, packed[:, 48:])
    return {"equal": torch.equal(packed, separate), "err": rel_err(packed, ref)}


# the interpreter run (module, seconds idle) whose results the `interpreter_results` fixture
# gives this file's tests (conftest.py; started in the background: tests/support/interpreter_run.py)
INTERPRETER = ("tests.layers.test_triton_ops", 600)


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter_rotary_store_kv(name, interpreter_results):
    errs = interpreter_results[name]
    assert isinstance(errs, dict), f"{name} raised {errs}"
    tol = 1e-6 if "fp32" in name and "into" not in name else 2e-3
    assert errs["ref"] <= tol, errs  # the PyTorch path
    assert errs["unfused"] == 0.0, errs  # bit-identical to the separate kernels
    assert errs["page0"] == 0.0, errs  # page 0: only slot 0, holding a padding token


def test_interpreter_norms_write_into_halves_of_one_buffer(interpreter_results):
    res = interpreter_results["norm-into-halves"]
    assert isinstance(res, dict), res
    assert res["equal"] and res["err"] < 2e-3, res


# ---- GPU: compiled at real shapes -------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fused_ops_match_modules(dtype):
    ops = _ops()
    assert rms_norm_error(ops, dtype, "cuda", rows=33, dim=4096) < TOL[dtype]
    assert add_rms_norm_error(ops, dtype, "cuda", rows=33, dim=4096) < TOL[dtype]
    assert (
        rotary_error(ops, dtype, "cuda", tokens=65, q_heads=32, k_heads=8, head_dim=128)
        < (TOL[dtype])
    )
    assert silu_and_mul_error(ops, dtype, "cuda", rows=17, dim=14336) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 4, 64, 300])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_rotary_store_kv(dtype, tokens, page_size):
    from specserve.kernels.attention import triton_kernels

    errs = rotary_store_errors(
        _ops(),
        triton_kernels,
        dtype,
        "cuda",
        tokens=tokens + 3,
        q_heads=32,
        kv_heads=8,
        head_dim=128,
        page_size=page_size,
        seed=tokens,
    )
    assert errs["ref"] < TOL[dtype], errs
    assert errs["unfused"] == 0.0, errs
    assert errs["page0"] == 0.0, errs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_model_with_triton_path_matches_torch(dtype, page_size):
    from specserve.layers.attention.triton_attn import TritonAttentionBackend

    err = model_error(TritonAttentionBackend(), dtype, "cuda", page_size, fused_ops=_ops())
    assert err < 3 * TOL[dtype], err


if __name__ == "__main__":  # the interpreter run (TRITON_INTERPRET=1), see the fixture
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.stdout.write("\n" + json.dumps(run_cases()) + "\n")
