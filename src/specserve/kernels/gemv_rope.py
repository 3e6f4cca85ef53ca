"""The qkv GEMV's `rope` epilogue (gemv.py): rotary of q and k and the paged K/V store of a
[q; k; v] projection, computed where its tiles are written. Each program holds one head's
rotary pairs side by side (column i of the head's first half next to column i + D / 2; the
GEMV's column map), rounds them as the plain GEMV's output and rotates them with
`triton_rotary.rope_pair`, the rotary + KV-store kernel's arithmetic, so results equal that
kernel after the plain GEMV bit for bit. A column's place in its tile does not change its
sum, so the map leaves every output value as the plain tile computes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specserve.kernels.gemv_configs import GemvConfig
from specserve.kernels.triton_rotary import rope_pair


@triton.jit
def rope_store(
    y,
    m,
    m_ok,
    head,
    j,
    pos_ptr,
    slot_ptr,
    cos_sin_ptr,
    q_ptr,
    k_cache,
    v_cache,
    stride_qm,
    stride_cs,
    stride_page,
    stride_slot,
    page_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
):
    """The `rope` epilogue for one tile y [BLOCK_M, BLOCK_N] (the output dtype) of head
    `head` of a [q; k; v] projection, its columns the pairs (j + c, j + c + HEAD_DIM / 2)
    side by side: q rotated into q_ptr [rows, Q_HEADS * HEAD_DIM], k rotated and v as is
    into the paged caches at the rows' slots (< 0: not stored)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    PAIRS: tl.constexpr = BLOCK_N // 2
    slot = tl.load(slot_ptr + m, mask=m_ok, other=-1)
    stored = (m_ok & (slot >= 0))[:, None]
    slot = tl.maximum(slot, 0)
    cache_row = ((slot // page_size).to(tl.int64) * stride_page + (slot % page_size) * stride_slot)[
        :, None
    ]
    # (each branch names its own values: Triton merges same-named values of both branches)
    if head >= Q_HEADS + K_HEADS:  # v: stored as computed
        c = tl.arange(0, BLOCK_N)
        v_dst = (
            v_cache
            + cache_row
            + (head - Q_HEADS - K_HEADS) * HEAD_DIM
            + (j + c // 2 + (c % 2) * HALF)[None, :]
        )
        tl.store(v_dst, y.to(v_cache.dtype.element_ty), mask=stored)
    else:
        dtype = y.dtype
        x1, x2 = tl.split(tl.reshape(y, [BLOCK_M, PAIRS, 2]))
        i = j + tl.arange(0, PAIRS)
        pos = tl.load(pos_ptr + m, mask=m_ok, other=0)
        cs = cos_sin_ptr + pos[:, None] * stride_cs + i[None, :]
        cos = tl.load(cs).to(dtype).to(tl.float32)
        sin = tl.load(cs + HALF).to(dtype).to(tl.float32)
        o1, o2 = rope_pair(x1.to(tl.float32), x2.to(tl.float32), cos, sin, dtype)
        if head < Q_HEADS:
            q_dst = q_ptr + m[:, None] * stride_qm + head * HEAD_DIM + i[None, :]
            tl.store(q_dst, o1.to(q_ptr.dtype.element_ty), mask=m_ok[:, None])
            tl.store(q_dst + HALF, o2.to(q_ptr.dtype.element_ty), mask=m_ok[:, None])
        else:
            k_dst = k_cache + cache_row + (head - Q_HEADS) * HEAD_DIM + i[None, :]
            tl.store(k_dst, o1.to(k_cache.dtype.element_ty), mask=stored)
            tl.store(k_dst + HALF, o2.to(k_cache.dtype.element_ty), mask=stored)


@dataclass(frozen=True)
class RopeStore:
    """What the `rope` epilogue needs: each row's position and KV slot (< 0: not stored), the
    cos/sin table [positions, D] (cos in the first half), the head counts, and the paged
    caches [pages, page_size, kv_heads, D] that k and v go to."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos_sin: torch.Tensor
    q_heads: int
    kv_heads: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor


# The row blocks the rope epilogue serves. On the H200 it pays at 16-row tiles (8B plain
# decode at batch 1: +1.6%, K=3 at batch 1: +3%) and loses at 64-row tiles (batch 64: -1.4%
# against cuBLAS's qkv and the rotary kernel).
ROPE_MAX_BLOCK_M = 16


def rope_fits(cfg: GemvConfig, head_dim: int, k: int) -> bool:
    """Whether `cfg` runs the rope epilogue on a projection of heads of head_dim and K
    inputs: a matrix-unit tile (a CUDA-core tile's sum over K follows the register layout,
    which the epilogue's pair split changes: on the H200 its q then differs from the plain
    tile's by an ulp) of at most ROPE_MAX_BLOCK_M rows whose columns hold whole pairs of one
    head (BLOCK_N divides head_dim), its weight rows through pointers (not a descriptor's
    contiguous tiles), K not split, and the data-parallel schedule (a stream-K tile's sum
    depends on which tiles its columns share)."""
    iters_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k)
    return (
        cfg.use_dot
        and cfg.block_m <= ROPE_MAX_BLOCK_M
        and not cfg.stream_k
        and head_dim % cfg.block_n == 0
        and cfg.block_n % 2 == 0
        and not cfg.tma
        and triton.cdiv(k, iters_per_split * cfg.block_k) == 1
    )


def rope_args(rope: RopeStore, n: int, head_dim: int) -> dict:
    """The kernel's rope arguments, after checking the shapes agree."""
    from specserve.kernels.attention.triton_kv_write import check_cache

    k_cache = rope.k_cache
    if n != (rope.q_heads + 2 * rope.kv_heads) * head_dim or k_cache.shape[2:] != (
        rope.kv_heads,
        head_dim,
    ):
        raise ValueError("a rope gemv needs a [q; k; v] weight of the cache's heads")
    check_cache(k_cache, rope.v_cache)
    return dict(
        pos_ptr=rope.positions,
        slot_ptr=rope.slot_mapping,
        cos_sin_ptr=rope.cos_sin,
        k_cache=k_cache,
        v_cache=rope.v_cache,
        stride_cs=rope.cos_sin.stride(0),
        stride_page=k_cache.stride(0),
        stride_slot=k_cache.stride(1),
        page_size=k_cache.shape[1],
        ROPE=True,
        HEAD_DIM=head_dim,
        Q_HEADS=rope.q_heads,
        K_HEADS=rope.kv_heads,
    )
