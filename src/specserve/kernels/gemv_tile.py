"""The GEMV kernel's per-tile pieces (kernels/gemv.py, gemv_stream_k.py): loading a tile of x
(with the SiLU-and-mul prologue) and of the weight, the tile product on the matrix units or
the CUDA cores, and the epilogue of one row block (bias, rounding, the
gated SiLU-and-mul, the rope store, or a K split's partial sums). Imported by gemv.py, like
it only when kernels may be defined.
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.kernels.gemv_rope import rope_store


@triton.jit
def silu_mul(g, u, DTYPE: tl.constexpr):
    """silu(g) * u for g, u loaded in DTYPE, with F.silu's rounding to DTYPE; shared by the
    SiLU-and-mul kernel (triton_ops.py) and the GEMV prologue, which must round alike."""
    g = g.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
    return (act * u.to(tl.float32)).to(DTYPE)


@triton.jit
def _load_x(x_rows, k, mask, K, SILU: tl.constexpr):
    """A [rows, BLOCK_K] tile of x; with SILU, silu(gate) * up from x rows [gate | up]."""
    if SILU:
        g = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
        u = tl.load(x_rows + K + k[None, :], mask=mask, other=0.0)
        return silu_mul(g, u, x_rows.dtype.element_ty)
    else:
        return tl.load(x_rows + k[None, :], mask=mask, other=0.0)


@triton.jit
def _load_rows(x_rows, k, m_ok, K, SILU: tl.constexpr, K_IN_BLOCKS: tl.constexpr):
    """`_load_x` of rows `m_ok` (rows past M read as zeros); K_IN_BLOCKS: K is a multiple of
    BLOCK_K and the columns need no mask."""
    if K_IN_BLOCKS:
        return _load_x(x_rows, k, m_ok[:, None], K, SILU)
    else:
        return _load_x(x_rows, k, m_ok[:, None] & (k < K)[None, :], K, SILU)


@triton.jit
def _w_tile(w_rows, w_desc, row0, k0, k, K, TMA: tl.constexpr, EVEN_K: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] weight tile: rows `w_rows` at columns k through pointers, or
    with TMA the descriptor's tile at (row0, k0) (rows past the weight and columns past K
    read as zeros)."""
    if TMA:
        return w_desc.load([row0, k0])
    elif EVEN_K:
        return tl.load(w_rows + k[None, :])
    else:
        return tl.load(w_rows + k[None, :], mask=(k < K)[None, :], other=0.0)


@triton.jit
def _mac(acc, x, w, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    """acc + x @ w^T: on the matrix units, or as per-thread products ([M, N, K] acc)."""
    if USE_DOT:
        if IEEE:
            return acc + tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            return acc + tl.dot(x, tl.trans(w))
    else:
        return acc + x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]


@triton.jit
def _finish(
    acc,
    acc_u,
    m,
    n,
    pid_s,
    M,
    N,
    b_ptr,
    out_ptr,
    stride_om,
    stride_os,
    head,
    j,
    pos_ptr,
    slot_ptr,
    cos_sin_ptr,
    k_cache,
    v_cache,
    stride_cs,
    stride_page,
    stride_slot,
    page_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    GATED: tl.constexpr,
    ROPE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
):
    """The epilogue of one row block `m`: partial sums to the split's workspace, or bias,
    rounding, GATED's SiLU-and-mul and ROPE's rotary and K/V store, and the output."""
    if not USE_DOT:
        acc = tl.sum(acc, axis=2)
        if GATED:
            acc_u = tl.sum(acc_u, axis=2)
    ok = (m < M)[:, None] & (n < N)[None, :]
    if PARTIAL:
        dst = out_ptr + pid_s * stride_os + m[:, None] * stride_om + n[None, :]
        tl.store(dst, acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(b_ptr + N + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        y = acc.to(out_ptr.dtype.element_ty)
        if GATED:  # rounded as the [gate | up] output, then as silu_and_mul rounds
            y = silu_mul(y, acc_u.to(out_ptr.dtype.element_ty), out_ptr.dtype.element_ty)
        if ROPE:  # rounded as the qkv output, then as rotary_store_kv rounds
            rope_store(
                y,
                m,
                m < M,
                head,
                j,
                pos_ptr,
                slot_ptr,
                cos_sin_ptr,
                out_ptr,
                k_cache,
                v_cache,
                stride_om,
                stride_cs,
                stride_page,
                stride_slot,
                page_size,
                BLOCK_M,
                BLOCK_N,
                HEAD_DIM,
                Q_HEADS,
                K_HEADS,
            )
        else:
            dst = out_ptr + m[:, None] * stride_om + n[None, :]
            tl.store(dst, y, mask=ok)
