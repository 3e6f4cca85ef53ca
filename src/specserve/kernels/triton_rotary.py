"""Triton rotary embedding: q and k rotated in one kernel, or, from a qkv projection row, q
rotated and k, v stored into the paged KV cache in the same kernel (the attention backend then
only attends). Same rounding as layers/rotary.py: each product and sum in the activation
dtype. Imported lazily through triton_ops.py (TRITON_INTERPRET is read when kernels are
defined).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl
from specserve.kernels.pdl_kernel import pdl_enter


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def rope_pair(x1, x2, cos, sin, DTYPE: tl.constexpr):
    """Rotated (x1, x2) halves (fp32 holding DTYPE values; cos, sin rounded to DTYPE) with
    the PyTorch path's rounding: each product and the sum in DTYPE. Shared by the kernels
    here and the qkv GEMV's epilogue (gemv.py), which must round alike."""
    o1 = _round(_round(x1 * cos, DTYPE) - _round(x2 * sin, DTYPE), DTYPE)
    o2 = _round(_round(x2 * cos, DTYPE) + _round(x1 * sin, DTYPE), DTYPE)
    return o1, o2


@triton.jit
def _rotate_rows(
    src,
    dst,
    src_stride_h,
    dst_stride_h,
    cos,
    sin,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate num_heads rows of one token (head h at src + h * src_stride_h) into dst."""
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    ok = (h < num_heads)[:, None] & (i < HALF)[None, :]
    src = src + h[:, None] * src_stride_h + i[None, :]
    dtype = src.dtype.element_ty
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    o1, o2 = rope_pair(x1, x2, cos, sin, dtype)
    dst = dst + h[:, None] * dst_stride_h + i[None, :]
    out_dtype = dst.dtype.element_ty
    tl.store(dst, o1.to(out_dtype), mask=ok)
    tl.store(dst + HALF, o2.to(out_dtype), mask=ok)


@triton.jit
def _rotate_heads(
    x_ptr,
    o_ptr,
    stride_t,
    stride_h,
    t,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    _rotate_rows(
        x_ptr + t * stride_t,
        o_ptr + t * NUM_HEADS * 2 * HALF,
        stride_h,
        2 * HALF,
        cos,
        sin,
        NUM_HEADS,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
    )


@triton.jit
def _cos_sin(
    cos_sin_ptr, pos, stride_cs, DTYPE: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=i_ok, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=i_ok, other=0.0)
    return _round(cos, DTYPE)[None, :], _round(sin, DTYPE)[None, :]


# Positions and slots are views into the step's one upload (runtime/packing.py), aligned or not
# with the token and request counts: not specialized on, or serving would compile new variants.
@triton.jit(do_not_specialize=["pos_ptr"])
def _rotary_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    pos_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        pdl_enter()
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    cos, sin = _cos_sin(cos_sin_ptr, pos, stride_cs, q_ptr.dtype.element_ty, HALF, BLOCK_HALF)
    _rotate_heads(
        q_ptr, qo_ptr, stride_qt, stride_qh, t, cos, sin, Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF
    )
    _rotate_heads(
        k_ptr, ko_ptr, stride_kt, stride_kh, t, cos, sin, K_HEADS, HALF, BLOCK_KH, BLOCK_HALF
    )


@triton.jit(do_not_specialize=["pos_ptr", "slot_ptr"])
def _rotary_store_kv_kernel(
    qkv_ptr,
    qo_ptr,
    k_cache,
    v_cache,
    pos_ptr,
    slot_ptr,
    cos_sin_ptr,
    stride_t,
    stride_cs,
    stride_page,
    stride_slot,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """One token of a qkv projection row [q heads | k heads | v heads]: rotated q to qo,
    rotated k and v straight into the paged cache at the token's slot (< 0: not stored)."""
    if USE_PDL:
        pdl_enter()
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    stored_heads = tl.where(slot >= 0, K_HEADS, 0)  # a negative slot: nothing stored
    slot = tl.maximum(slot, 0)
    row = qkv_ptr + t * stride_t
    cos, sin = _cos_sin(cos_sin_ptr, pos, stride_cs, qkv_ptr.dtype.element_ty, HALF, BLOCK_HALF)
    _rotate_rows(
        row,
        qo_ptr + t * Q_HEADS * HEAD_DIM,
        HEAD_DIM,
        HEAD_DIM,
        cos,
        sin,
        Q_HEADS,
        HALF,
        BLOCK_QH,
        BLOCK_HALF,
    )
    dst = (slot // PAGE_SIZE) * stride_page + (slot % PAGE_SIZE) * stride_slot
    _rotate_rows(
        row + Q_HEADS * HEAD_DIM,
        k_cache + dst,
        HEAD_DIM,
        HEAD_DIM,
        cos,
        sin,
        stored_heads,
        HALF,
        BLOCK_KH,
        BLOCK_HALF,
    )
    cols = tl.arange(0, BLOCK_V)
    v_ok = cols < stored_heads * HEAD_DIM
    v = tl.load(row + (Q_HEADS + K_HEADS) * HEAD_DIM + cols, mask=v_ok)
    tl.store(v_cache + dst + cols, v.to(v_cache.dtype.element_ty), mask=v_ok)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor):
    """Rotate-half rotary embedding of q [T, Hq, D] and k [T, Hk, D] (new tensors)."""
    num_tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    half = head_dim // 2
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q,
            k,
            q_out,
            k_out,
            positions,
            cos_sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos_sin.stride(0),
            Q_HEADS=q_heads,
            K_HEADS=k_heads,
            HALF=half,
            BLOCK_QH=triton.next_power_of_2(q_heads),
            BLOCK_KH=triton.next_power_of_2(k_heads),
            BLOCK_HALF=triton.next_power_of_2(half),
            **pdl.launch_options(q.device),
        )
    return q_out, k_out


def rotary_store_kv(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    cos_sin: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """From a qkv projection [T, (q_heads + 2 * kv_heads) * D]: rotary of q and k at
    `positions`, k and v stored at `slot_mapping` in the paged caches [pages, page_size,
    kv_heads, D] (slots < 0 skipped), all in one kernel; returns the rotated q [T, q_heads,
    D]. Same values as `rotary` followed by the attention backend's KV write."""
    from specserve.kernels.attention.triton_kernels import check_cache

    num_tokens = qkv.shape[0]
    head_dim = k_cache.shape[3]
    if qkv.shape[1] != (q_heads + 2 * kv_heads) * head_dim or k_cache.shape[2] != kv_heads:
        raise ValueError("qkv rows must hold q_heads + 2 * kv_heads heads of the cache's size")
    check_cache(k_cache, v_cache)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q_out = torch.empty((num_tokens, q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    half = head_dim // 2
    if num_tokens:
        _rotary_store_kv_kernel[(num_tokens,)](
            qkv,
            q_out,
            k_cache,
            v_cache,
            positions,
            slot_mapping,
            cos_sin,
            qkv.stride(0),
            cos_sin.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            Q_HEADS=q_heads,
            K_HEADS=kv_heads,
            HEAD_DIM=head_dim,
            HALF=half,
            PAGE_SIZE=k_cache.shape[1],
            BLOCK_QH=triton.next_power_of_2(q_heads),
            BLOCK_KH=triton.next_power_of_2(kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_V=triton.next_power_of_2(kv_heads * head_dim),
            **pdl.launch_options(qkv.device),
        )
    return q_out
