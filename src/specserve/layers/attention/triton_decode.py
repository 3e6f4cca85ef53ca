"""The decode-path attention kernel: steps of at most DECODE_MAX_ROWS query rows per request
(decode, and verify of K+1 tokens), all of a request's rows in one block, built for
bandwidth. Same arguments, grid and outputs as `_paged_attn_kernel` (triton_kernels.py):
one program per (request, KV head, split) reads each K/V block once for the whole query-head
group.

Where the time goes at decode is waiting on memory, so: the metadata a program needs before
its first K/V bytes take two round trips (request bounds and length, then positions,
queries and the first page ids together) instead of four; K and V of a block are requested
together; the page ids of the next block are fetched a block ahead, which lets Triton's
pipeliner (num_stages >= 3) keep the next K/V block in flight in shared memory while this
one is computed. PREFETCH does that by hand instead, in registers (no pipeliner).

ROPE: the kernel takes the qkv projection's rows instead of q and does the rotary and the
K/V store itself (one kernel less per layer; `paged_attention(rope=)`, see `_new_kv`).

Imported by triton_kernels.py, and like it only when kernels may be defined (TRITON_INTERPRET
is read then).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from specserve.layers.pdl_kernel import pdl_enter
from specserve.layers.triton_rotary import _round


class Rope(NamedTuple):
    """What the decode kernel needs to take a qkv projection's rows [T, (q_heads + 2 *
    kv_heads) * head_dim] instead of q (`paged_attention(rope=)`): the rotary table
    [max_pos, head_dim] (fp32: cos in the first half, sin in the second), each token's KV
    slot (< 0: not stored) and the number of query heads."""

    cos_sin: torch.Tensor
    slot_mapping: torch.Tensor
    q_heads: int


def check_rope(qkv: torch.Tensor, rope: Rope, kv_heads: int, head_dim: int,
               served: bool) -> None:  # fmt: skip
    """Raise unless paged_attention can take these qkv rows with this rotary table."""
    width = (rope.q_heads + 2 * kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or rope.q_heads % kv_heads:
        raise ValueError(f"with rope, q must be qkv rows [T, {width}] (q_heads "
                         f"{rope.q_heads} + 2 * {kv_heads} KV heads of {head_dim}), "
                         f"got {tuple(qkv.shape)}")  # fmt: skip
    cos_sin = rope.cos_sin
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim or cos_sin.stride(1) != 1:
        raise ValueError(f"rope.cos_sin must be a [max_pos, {head_dim}] table with "
                         "contiguous rows")  # fmt: skip
    if not served:
        raise ValueError("rope needs a step the decode kernel serves: at most DECODE_MAX_ROWS "
                         "query rows per request and a kernel other than 'generic'")


@triton.jit
def _attend_block(q, k, v, n, n_ok, pos, m_i, l_i, acc, qk_scale):
    """One K/V block of online softmax for the rows of q at positions `pos`."""
    s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
    s = tl.where((n[None, :] <= pos[:, None]) & n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc


@triton.jit
def _kv_load(k_cache, v_cache, page, n, n_ok, kvh, stride_cp, stride_cs, stride_ch, d, d_ok,
             PAGE_SIZE: tl.constexpr):  # fmt: skip
    """Issue the loads of one K/V block: keys n of KV head kvh, their pages already known."""
    off = page.to(tl.int64) * stride_cp + (n % PAGE_SIZE) * stride_cs + kvh * stride_ch
    mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache + off[:, None] + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_cache + off[:, None] + d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _rope(src, pos, ok, cos_sin, stride_rope, d, HEAD_DIM: tl.constexpr):
    """Rotary of head rows (row r: HEAD_DIM values at src[r], position pos[r], ok[r] or 0) as
    a [rows, BLOCK_D] tile: each column d with its partner d +/- HALF, the rounding of
    triton_rotary._rotate_rows (cos, sin, each product and the sum in the activation dtype;
    a - b there, the same bits as a + (-b)). Returns fp32 holding activation-dtype values."""
    HALF = HEAD_DIM // 2
    first = d < HALF
    i = tl.where(first, d, d - HALF)
    mask = ok[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(src[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(src[:, None] + tl.where(first, d + HALF, i)[None, :], mask=mask,
                      other=0.0).to(tl.float32)  # fmt: skip
    dtype = src.dtype.element_ty
    row = cos_sin + pos[:, None] * stride_rope + i[None, :]
    cos = _round(tl.load(row, mask=mask, other=0.0), dtype)
    sin = _round(tl.load(row + HALF, mask=mask, other=0.0), dtype)
    xc, ps = _round(x * cos, dtype), _round(partner * sin, dtype)
    return _round(tl.where(first[None, :], xc - ps, xc + ps), dtype)


@triton.jit
def _new_kv(qkv, cos_sin, positions, slot_mapping, q_start, q_len, kvh, chunk, pid_s,
            num_splits, stride_qt, stride_qh, stride_rope, stride_cp, stride_cs, stride_ch, d,
            d_ok, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
            PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    """KV head kvh's part of rotary_store_kv (triton_rotary.py) for the request's new tokens
    whose key index (their position) lies in this program's chunk [pid_s * chunk, (pid_s +
    1) * chunk): k rotated and v, [BLOCK_T, BLOCK_D] each, their cache offsets and the mask
    of what to store (other chunks' tokens and slots < 0 left out), for the caller to store.

    Each token is stored by exactly one program of its (request, KV head), that of split
    pos // chunk: the splits' chunks tile [0, num_splits * chunk), which covers [0,
    seq_len), and the last split also takes positions past that (never read: keys stop at
    seq_len). No other program reads the key: only the one whose chunk holds key index p
    reads it, at block_tables[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE, which is the
    token's slot (the runner derives slots from the page tables so, and a step writes only
    to pages of its own request). The one exception is harmless: padding tokens write slot
    0 (the scratch page), which the graph runner's padded requests read, so those requests'
    discarded outputs may or may not see another program's write."""
    t = tl.arange(0, BLOCK_T)
    t_ok = t < q_len
    pos = tl.load(positions + q_start + t, mask=t_ok, other=0).to(tl.int32)
    slot = tl.load(slot_mapping + q_start + t, mask=t_ok, other=-1)
    owner = tl.minimum(tl.maximum(pos, 0) // tl.maximum(chunk, 1), num_splits - 1)  # its split
    mine = t_ok & (slot >= 0) & (owner == pid_s)
    row = qkv + (q_start + t) * stride_qt
    k = _rope(row + (Q_HEADS + kvh) * stride_qh, pos, mine, cos_sin, stride_rope, d, HEAD_DIM)
    mask = mine[:, None] & d_ok[None, :]
    v_row = row + (Q_HEADS + KV_HEADS + kvh) * stride_qh
    v = tl.load(v_row[:, None] + d[None, :], mask=mask, other=0.0)
    slot = tl.maximum(slot, 0)
    dst = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs + kvh * stride_ch
    return k, v, dst[:, None] + d[None, :], mask


# The step's metadata are views into one upload whose alignment varies from step to step:
# not specialized on (see triton_kernels.py, where the generic kernel does the same).
METADATA = ["positions", "query_start_loc", "seq_lens", "block_tables"]
# What neither attention kernel specializes on: strides and split counts that vary with the
# batch, and the metadata addresses.
NOT_SPECIALIZED = ["stride_bt", "num_splits", "stride_os", "stride_ls", "stride_lt", *METADATA]


@triton.jit(do_not_specialize=[*NOT_SPECIALIZED, "slot_mapping"])  # slots: step metadata too
def _paged_attn_decode_kernel(
    q_ptr, k_cache, v_cache, out_ptr, lse_ptr,
    positions, query_start_loc, seq_lens, block_tables,
    stride_qt, stride_qh, stride_cp, stride_cs, stride_ch, stride_bt,
    stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    qk_scale, num_splits, cos_sin, slot_mapping, stride_rope,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
    ROPE: tl.constexpr = False, BLOCK_T: tl.constexpr = 1, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # Same arguments and grid as _paged_attn_kernel (plus the rotary's: cos_sin table, slots
    # and the table's row stride, unused without ROPE); all of a request's rows fit BLOCK_M.
    # ROPE: q_ptr holds qkv rows [q heads | k heads | v heads] (head stride stride_qh).
    if USE_PDL:  # layers/pdl.py: q (or qkv) and the new K/V come from the kernel before
        pdl_enter()
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // KV_HEADS
    kvh = pid_bh % KV_HEADS
    q_start = tl.load(query_start_loc + b).to(tl.int32)
    q_len = tl.load(query_start_loc + b + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    # Chunks follow the request's length (not its last position), so the first block's page
    # ids are requested together with the positions and the queries.
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = pid_s * chunk
    table = block_tables + b * stride_bt
    n = lo + tl.arange(0, BLOCK_N)
    page = tl.load(table + n // PAGE_SIZE, mask=n < seq_len, other=0)
    rows = tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < q_len
    pos = tl.load(positions + q_start + tok, mask=row_ok, other=-1).to(tl.int32)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    if ROPE:  # every load before the stores: the new keys' chain first, then q's
        k_new, v_new, dst, new_ok = _new_kv(
            q_ptr, cos_sin, positions, slot_mapping, q_start, q_len, kvh, chunk, pid_s,
            num_splits, stride_qt, stride_qh, stride_rope, stride_cp, stride_cs, stride_ch, d,
            d_ok, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM, PAGE_SIZE, BLOCK_T,
        )  # fmt: skip
        q_row = q_ptr + (q_start + tok) * stride_qt + head * stride_qh
        q = _rope(q_row, pos, row_ok, cos_sin, stride_rope, d, HEAD_DIM)
        q = q.to(q_ptr.dtype.element_ty)
        tl.store(k_cache + dst, k_new.to(k_cache.dtype.element_ty), mask=new_ok)
        tl.store(v_cache + dst, v_new.to(v_cache.dtype.element_ty), mask=new_ok)
        # The loop below reads the new keys through the cache like any other key. Only this
        # program reads them (_new_kv), so a CTA barrier suffices: after bar.sync every
        # thread's earlier stores are visible to the CTA's threads' later accesses (PTX
        # memory model). The loop's loads are pointer loads: ld.global, or cp.async into
        # shared memory where Triton pipelines them (a weak read in the generic proxy, like
        # ld.global), all issued after the barrier, the pipeline's prologue included (sm_90
        # PTX: every load of this block, the two stores, bar.sync, then the first cp.async).
        # A TMA load (async proxy) would need a proxy fence too.
        tl.debug_barrier()
    else:
        q_off = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # Keys visible to any row: up to the last position (positions ascend), within seq_len.
    hi = tl.minimum(lo + chunk, tl.minimum(seq_len, tl.max(pos, 0) + 1))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_ok = n < hi
    if PREFETCH:  # K/V of this block in registers, the next block's page ids in flight
        k, v = _kv_load(k_cache, v_cache, page, n, n_ok, kvh, stride_cp, stride_cs, stride_ch,
                        d, d_ok, PAGE_SIZE)  # fmt: skip
        page = tl.load(table + (n + BLOCK_N) // PAGE_SIZE, mask=n + BLOCK_N < hi, other=0)
    for _ in range(lo, hi, BLOCK_N):
        n_next = n + BLOCK_N
        ok_next = n_next < hi
        if PREFETCH:  # the next block's K/V load while this block is computed
            k_next, v_next = _kv_load(k_cache, v_cache, page, n_next, ok_next, kvh, stride_cp,
                                      stride_cs, stride_ch, d, d_ok, PAGE_SIZE)  # fmt: skip
            page = tl.load(table + (n_next + BLOCK_N) // PAGE_SIZE,
                           mask=n_next + BLOCK_N < hi, other=0)  # fmt: skip
            m_i, l_i, acc = _attend_block(q, k, v, n, n_ok, pos, m_i, l_i, acc, qk_scale)
            k, v = k_next, v_next
        else:  # K and V requested together, the next page ids alongside
            k, v = _kv_load(k_cache, v_cache, page, n, n_ok, kvh, stride_cp, stride_cs,
                            stride_ch, d, d_ok, PAGE_SIZE)  # fmt: skip
            page = tl.load(table + n_next // PAGE_SIZE, mask=ok_next, other=0)
            m_i, l_i, acc = _attend_block(q, k, v, n, n_ok, pos, m_i, l_i, acc, qk_scale)
        n, n_ok = n_next, ok_next

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = pid_s * stride_os + (q_start + tok)[:, None] * stride_ot
    o_off += head[:, None] * stride_oh + d[None, :]
    o_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        tl.store(out_ptr + o_off, out, mask=o_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        l_off = pid_s * stride_ls + (q_start + tok) * stride_lt + head
        tl.store(lse_ptr + l_off, lse, mask=row_ok)
    else:
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)
