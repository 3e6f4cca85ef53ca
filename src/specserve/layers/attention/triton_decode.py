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

A split step's partials are merged by `merge_splits`, one formula for the separate merge
kernel (triton_kernels.py) and for this kernel's own merge (FUSED_MERGE): the program of a
(row block, request, KV head) that stores the last of its splits merges them all, so a
split step is one kernel, not two (the merge kernel was ~3 us of launch gap per layer at
batch 1 on the H200). Same loads, order and arithmetic per element: the same bits.

Imported by triton_kernels.py, and like it only when kernels may be defined (TRITON_INTERPRET
is read then).
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.layers.pdl_kernel import pdl_enter


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
def merge_splits(part, lse, mask, row_ok, num_splits, stride_ps, stride_ls,
                 BLOCK_S: tl.constexpr):  # fmt: skip
    """Rows of a split step merged: `part` points at split 0's fp32 partial outputs of the
    rows ([rows, BLOCK_D], `mask` the valid elements), `lse` at their log2-sum-exps ([rows],
    `row_ok`); split s is `s * stride_ps` / `s * stride_ls` further. Each row's partials are
    weighed by 2^(lse - max lse) and the sum divided by the weights' (fp32, not cast).

    The splits are added one after the other, unrolled over BLOCK_S (the loads independent
    of each other; past num_splits they reread the last split and weigh 0), so the sum's
    order does not depend on how Triton lays out the tile: the separate merge kernel (one
    row) and the decode kernel's fused merge (a block of rows) give the same bits for the
    same BLOCK_S. Loads go past L1 (.cg): in the fused merge other programs stored these
    moments ago, and their lines must come from L2."""
    m = tl.load(lse, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
    for s in tl.static_range(1, BLOCK_S):  # a split step has at least two splits
        last = tl.minimum(num_splits - 1, s)
        m = tl.maximum(m, tl.load(lse + last * stride_ls, mask=row_ok, other=float("-inf"),
                                  cache_modifier=".cg"))  # fmt: skip
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = m * 0.0
    acc = tl.zeros(part.shape, tl.float32)
    for s in tl.static_range(0, BLOCK_S):
        last = tl.minimum(num_splits - 1, s)
        lse_s = tl.load(lse + last * stride_ls, mask=row_ok, other=float("-inf"),
                        cache_modifier=".cg")  # fmt: skip
        w = tl.where(last == s, tl.exp2(lse_s - m), 0.0)  # empty splits weigh 0 too
        denom += w
        acc += tl.load(part + last * stride_ps, mask=mask, other=0.0,
                       cache_modifier=".cg") * w[:, None]  # fmt: skip
    return acc / tl.where(denom > 0, denom, 1.0)[:, None]


@triton.jit
def _merge_if_last(part, lse, mask, row_ok, final, counter, num_splits, stride_ps, stride_ls,
                   BLOCK_S: tl.constexpr):  # fmt: skip
    """Called by every split's program once its partial and lse are stored: the last of a
    (row block, request, KV head)'s num_splits programs to get here merges all of them into
    `final` (these rows' output elements, in the output's dtype) and sets `counter` back to
    0 for the next launch (CUDA-graph replays reuse it: no memset per step).

    Memory ordering. Triton lowers a scalar atomic to one thread of the program (thread 0,
    the others predicated off) and hands its old value to every thread through shared memory
    behind a CTA barrier (checked in the sm_90 PTX of triton 3.9: `@p atom.global.gpu.
    acq_rel.add.u32`, `@p st.shared`, `bar.sync`, `ld.shared` by all), so `arrived` is the
    same in all threads and the branch below is uniform.
    Writer side: the barrier first orders every thread's partial/lse stores before thread
    0's atomic (CTA scope), and the atomic's release at GPU scope, cumulative in the PTX
    memory model, publishes them with it. Merger side: the atomic's acquire (GPU
    scope) reads the last writer's release, so every split's stores happen before it, and
    the barrier inside the atomic's lowering extends that to the program's other threads;
    their loads go past L1 (.cg, in merge_splits) so that no line this SM's L1 may hold
    stands in for what the other SMs wrote to L2. The next kernel (under PDL too) waits for
    the whole grid, the merge included."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == num_splits - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # every split has counted
        merged = merge_splits(part, lse, mask, row_ok, num_splits, stride_ps, stride_ls,
                              BLOCK_S)  # fmt: skip
        tl.store(final, merged.to(final.dtype.element_ty), mask=mask)


# The step's metadata are views into one upload whose alignment varies from step to step:
# not specialized on (see triton_kernels.py, where the generic kernel does the same).
METADATA = ["positions", "query_start_loc", "seq_lens", "block_tables"]
# What neither attention kernel specializes on: strides and split counts that vary with the
# batch, and the metadata addresses.
NOT_SPECIALIZED = ["stride_bt", "num_splits", "stride_os", "stride_ls", "stride_lt", *METADATA]


@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def _paged_attn_decode_kernel(
    q_ptr, k_cache, v_cache, out_ptr, lse_ptr,
    positions, query_start_loc, seq_lens, block_tables,
    stride_qt, stride_qh, stride_cp, stride_cs, stride_ch, stride_bt,
    stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    qk_scale, num_splits,
    final_ptr, arrivals, stride_ft, stride_fh,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
    FUSED_MERGE: tl.constexpr = False, BLOCK_S: tl.constexpr = 32,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # Same arguments and grid as _paged_attn_kernel, plus the fused merge's: the output
    # (final_ptr, in its dtype) and the arrival counters (int32, one per (row block, request,
    # KV head), zero between launches). All of a request's rows fit BLOCK_M.
    if USE_PDL:  # layers/pdl.py: q and the new K/V come from the kernel before
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
    row_off = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    o_off = pid_s * stride_os + row_off
    o_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        tl.store(out_ptr + o_off, out, mask=o_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        lse_off = (q_start + tok) * stride_lt + head
        tl.store(lse_ptr + pid_s * stride_ls + lse_off, lse, mask=row_ok)
        if FUSED_MERGE:  # the last split to get here merges them all
            counter = arrivals + tl.program_id(0) * tl.num_programs(1) + pid_bh
            f_off = (q_start + tok)[:, None] * stride_ft + head[:, None] * stride_fh
            _merge_if_last(out_ptr + row_off, lse_ptr + lse_off, o_mask, row_ok,
                           final_ptr + f_off + d[None, :], counter, num_splits, stride_os,
                           stride_ls, BLOCK_S)  # fmt: skip
    else:
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)
