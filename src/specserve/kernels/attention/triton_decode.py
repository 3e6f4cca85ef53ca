"""The decode-path attention kernel: steps of at most DECODE_MAX_ROWS query rows per request
(decode, and verify of K+1 tokens), all of a request's rows in one block, built for
bandwidth. Same arguments, grid and outputs as `_paged_attn_kernel` (triton_kernels.py):
one program per (request, KV head, split) reads each K/V block once for the whole query-head
group.

Where the time goes at decode is waiting on memory, so: the metadata a program needs before
its first K/V bytes take two round trips (request bounds and length, then positions,
queries and the first page ids together) instead of four; under PDL the metadata loads
happen before the wait for the kernels before, the queries' after it (torch ops and copies
write the metadata, no PDL kernel: kernels/pdl.py; q and the newest K/V come from the
kernels before; asking L2 for the first K/V block before the wait too lost 2% at batch 64
on the H200); K and V of a block are requested together; the page
ids of the next block are fetched a block ahead, which lets Triton's pipeliner
(num_stages >= 3) keep the next K/V block in flight in shared memory while this one is
computed. PREFETCH does that by hand instead, in registers (no pipeliner).

Imported by triton_kernels.py, and like it only when kernels may be defined (TRITON_INTERPRET
is read then).
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.kernels.pdl_kernel import pdl_enter


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
def _kv_load(
    k_cache,
    v_cache,
    page,
    n,
    n_ok,
    kvh,
    stride_cp,
    stride_cs,
    stride_ch,
    d,
    d_ok,
    PAGE_SIZE: tl.constexpr,
):
    """Issue the loads of one K/V block: keys n of KV head kvh, their pages already known."""
    off = page.to(tl.int64) * stride_cp + (n % PAGE_SIZE) * stride_cs + kvh * stride_ch
    mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache + off[:, None] + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_cache + off[:, None] + d[None, :], mask=mask, other=0.0)
    return k, v


# The step's metadata are views into one upload whose alignment varies from step to step:
# not specialized on (see triton_kernels.py, where the generic kernel does the same).
METADATA = ["positions", "query_start_loc", "seq_lens", "block_tables"]
# What neither attention kernel specializes on: strides and split counts that vary with the
# batch, and the metadata addresses (nchunk_ptr is seq_lens where nothing is split).
NOT_SPECIALIZED = [
    "stride_bt",
    "num_splits",
    "chunk_splits",
    "min_chunk",
    "stride_os",
    "stride_ls",
    "stride_lt",
    "nchunk_ptr",
    *METADATA,
]


@triton.jit
def chunk_len(length, chunk_splits, min_chunk, BLOCK_N: tl.constexpr):
    """The chunk a key length is cut into: length over chunk_splits, in whole blocks, at
    least min_chunk keys (a multiple of BLOCK_N). It changes only where length crosses a
    multiple of chunk_splits * BLOCK_N past chunk_splits * min_chunk."""
    return tl.maximum(tl.cdiv(tl.cdiv(length, chunk_splits), BLOCK_N) * BLOCK_N, min_chunk)


@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def _paged_attn_decode_kernel(
    q_ptr,
    k_cache,
    v_cache,
    out_ptr,
    lse_ptr,
    positions,
    query_start_loc,
    seq_lens,
    block_tables,
    stride_qt,
    stride_qh,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    qk_scale,
    num_splits,
    chunk_splits,
    min_chunk,
    nchunk_ptr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    LOOP: tl.constexpr = False,
    ROW_CHUNKS: tl.constexpr = False,
    EARLY_METADATA: tl.constexpr = True,
):
    # Same arguments and grid as _paged_attn_kernel; all of a request's rows fit BLOCK_M.
    # LOOP: fewer programs than chunks (otherwise each program has at most its own chunk,
    # and the kernel compiles without the loop, whose registers it does not need).
    # ROW_CHUNKS (triton_kernels.py): each row's keys are chunked by its own length.
    if USE_PDL and not EARLY_METADATA:  # the wait before any read
        pdl_enter()
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // KV_HEADS
    kvh = pid_bh % KV_HEADS
    q_start = tl.load(query_start_loc + b).to(tl.int32)
    q_len = tl.load(query_start_loc + b + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    # The keys in chunks of a length over chunk_splits; program pid_s takes chunks pid_s,
    # pid_s + num_splits, ... The length is the request's (or with ROW_CHUNKS its first new
    # token's: its new tokens sit at the positions before seq_len), known before the
    # positions are, so the first block's page ids are requested with them and the queries.
    if ROW_CHUNKS:
        chunk = chunk_len(tl.maximum(seq_len - q_len + 1, 1), chunk_splits, min_chunk, BLOCK_N)
        num_chunks = tl.minimum(tl.cdiv(seq_len, chunk), chunk_splits)  # its rows need no more
    else:
        chunk = chunk_len(seq_len, chunk_splits, min_chunk, BLOCK_N)
        num_chunks = tl.cdiv(seq_len, chunk)
    table = block_tables + b * stride_bt
    n = pid_s * chunk + tl.arange(0, BLOCK_N)
    page = tl.load(table + n // PAGE_SIZE, mask=n < seq_len, other=0)
    rows = tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < q_len
    pos = tl.load(positions + q_start + tok, mask=row_ok, other=-1).to(tl.int32)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    if USE_PDL and EARLY_METADATA:  # kernels/pdl.py: q and the new K/V come from kernels before
        pdl_enter()  # (the metadata above is written by no PDL kernel: read before it)
    q_off = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # Keys visible to any row: up to the last position (positions ascend), within seq_len.
    kv_end = tl.minimum(seq_len, tl.max(pos, 0) + 1)
    # ROW_CHUNKS: the chunk of the step's last rows
    chunk_b = chunk_len(seq_len, chunk_splits, min_chunk, BLOCK_N)
    if SPLIT:  # each row's partials for the merge: how many, and (ROW_CHUNKS) from which slot
        if pid_s == 0:
            count = num_chunks + rows * 0
            if ROW_CHUNKS:  # rows past a chunk boundary: the second chunking, slots S..2S-1
                later = chunk_len(pos + 1, chunk_splits, min_chunk, BLOCK_N) != chunk
                count = tl.where(later, tl.cdiv(seq_len, chunk_b) + chunk_splits * 256, count)
            tl.store(nchunk_ptr + (q_start + tok) * stride_lt + head, count, mask=row_ok)
    _chunks(
        q,
        k_cache,
        v_cache,
        out_ptr,
        lse_ptr,
        table,
        page,
        n,
        pid_s,
        num_splits,
        chunk,
        num_chunks,
        0,
        seq_len,
        kv_end,
        kvh,
        pos,
        q_start,
        tok,
        head,
        row_ok,
        stride_cp,
        stride_cs,
        stride_ch,
        stride_os,
        stride_ot,
        stride_oh,
        stride_ls,
        stride_lt,
        d,
        d_ok,
        qk_scale,
        BLOCK_M,
        BLOCK_D,
        PAGE_SIZE,
        BLOCK_N,
        SPLIT,
        PREFETCH,
        LOOP,
    )
    if ROW_CHUNKS:
        if chunk_b != chunk:  # the step's rows cross a chunk boundary (at most one)
            n = pid_s * chunk_b + tl.arange(0, BLOCK_N)
            page = tl.load(table + n // PAGE_SIZE, mask=n < seq_len, other=0)
            _chunks(
                q,
                k_cache,
                v_cache,
                out_ptr,
                lse_ptr,
                table,
                page,
                n,
                pid_s,
                num_splits,
                chunk_b,
                tl.cdiv(seq_len, chunk_b),
                chunk_splits,
                seq_len,
                kv_end,
                kvh,
                pos,
                q_start,
                tok,
                head,
                row_ok,
                stride_cp,
                stride_cs,
                stride_ch,
                stride_os,
                stride_ot,
                stride_oh,
                stride_ls,
                stride_lt,
                d,
                d_ok,
                qk_scale,
                BLOCK_M,
                BLOCK_D,
                PAGE_SIZE,
                BLOCK_N,
                SPLIT,
                PREFETCH,
                LOOP,
            )


@triton.jit
def _chunks(
    q,
    k_cache,
    v_cache,
    out_ptr,
    lse_ptr,
    table,
    page,
    n,
    pid_s,
    num_splits,
    chunk,
    num_chunks,
    slot_base,
    seq_len,
    kv_end,
    kvh,
    pos,
    q_start,
    tok,
    head,
    row_ok,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    d,
    d_ok,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,
    LOOP: tl.constexpr,
):
    """The program's chunks of one chunking (n, page: its first chunk's first keys and page
    ids), each to slot slot_base + its index."""
    if LOOP and not PREFETCH:  # one pipelined loop over the blocks of all its chunks
        _flat_chunks(
            q,
            k_cache,
            v_cache,
            out_ptr,
            lse_ptr,
            table,
            page,
            pid_s,
            num_splits,
            chunk,
            num_chunks,
            slot_base,
            kv_end,
            kvh,
            pos,
            q_start,
            tok,
            head,
            row_ok,
            stride_cp,
            stride_cs,
            stride_ch,
            stride_os,
            stride_ot,
            stride_oh,
            stride_ls,
            stride_lt,
            d,
            d_ok,
            qk_scale,
            BLOCK_M,
            BLOCK_D,
            PAGE_SIZE,
            BLOCK_N,
        )
    elif LOOP:
        for j in range(pid_s, num_chunks, num_splits):
            if j != pid_s:  # this chunk's first page ids (the first chunk's are in hand)
                n = j * chunk + tl.arange(0, BLOCK_N)
                page = tl.load(table + n // PAGE_SIZE, mask=n < seq_len, other=0)
            _chunk_out(
                q,
                k_cache,
                v_cache,
                out_ptr,
                lse_ptr,
                table,
                page,
                n,
                j,
                slot_base + j,
                chunk,
                kv_end,
                kvh,
                pos,
                q_start,
                tok,
                head,
                row_ok,
                stride_cp,
                stride_cs,
                stride_ch,
                stride_os,
                stride_ot,
                stride_oh,
                stride_ls,
                stride_lt,
                d,
                d_ok,
                qk_scale,
                BLOCK_M,
                BLOCK_D,
                PAGE_SIZE,
                BLOCK_N,
                SPLIT,
                PREFETCH,
            )
    else:  # past the request's chunks the program writes an empty partial, never merged
        _chunk_out(
            q,
            k_cache,
            v_cache,
            out_ptr,
            lse_ptr,
            table,
            page,
            n,
            pid_s,
            slot_base + pid_s,
            chunk,
            kv_end,
            kvh,
            pos,
            q_start,
            tok,
            head,
            row_ok,
            stride_cp,
            stride_cs,
            stride_ch,
            stride_os,
            stride_ot,
            stride_oh,
            stride_ls,
            stride_lt,
            d,
            d_ok,
            qk_scale,
            BLOCK_M,
            BLOCK_D,
            PAGE_SIZE,
            BLOCK_N,
            SPLIT,
            PREFETCH,
        )


@triton.jit
def _flat_chunks(
    q,
    k_cache,
    v_cache,
    out_ptr,
    lse_ptr,
    table,
    page,
    pid_s,
    num_splits,
    chunk,
    num_chunks,
    slot_base,
    kv_end,
    kvh,
    pos,
    q_start,
    tok,
    head,
    row_ok,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    d,
    d_ok,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The program's chunks pid_s, pid_s + num_splits, ... as one loop over their key blocks
    (page: the first block's page ids), so that the pipeliner keeps the next block in flight
    across chunk ends too (a chunk may be a single block); at each chunk's last block its
    partial goes to slot slot_base + its index and the running sums restart. Each chunk's
    sums are `_attend_chunk`'s bit for bit: a block past the chunk's keys is fully masked,
    which leaves the sums exactly as they were."""
    blocks = chunk // BLOCK_N  # per chunk
    total = tl.cdiv(tl.maximum(num_chunks - pid_s, 0), num_splits) * blocks
    keys = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for i in range(0, total):
        j = pid_s + (i // blocks) * num_splits
        n = j * chunk + (i % blocks) * BLOCK_N + keys
        n_ok = n < tl.minimum(j * chunk + chunk, kv_end)
        k, v = _kv_load(
            k_cache,
            v_cache,
            page,
            n,
            n_ok,
            kvh,
            stride_cp,
            stride_cs,
            stride_ch,
            d,
            d_ok,
            PAGE_SIZE,
        )
        nxt = (pid_s + ((i + 1) // blocks) * num_splits) * chunk + ((i + 1) % blocks) * BLOCK_N
        # (after the last block: unused, and read only within the request's keys)
        page = tl.load(table + (nxt + keys) // PAGE_SIZE, mask=nxt + keys < kv_end, other=0)
        m_i, l_i, acc = _attend_block(q, k, v, n, n_ok, pos, m_i, l_i, acc, qk_scale)
        end = tok * 0 + i % blocks == blocks - 1  # per row (all alike): the chunk's last block
        store_chunk(
            out_ptr,
            lse_ptr,
            m_i,
            l_i,
            acc,
            slot_base + j,
            q_start,
            tok,
            head,
            row_ok & end,
            d,
            d_ok,
            stride_os,
            stride_ot,
            stride_oh,
            stride_ls,
            stride_lt,
            True,
        )
        m_i = tl.where(end, float("-inf"), m_i)
        l_i = tl.where(end, 0.0, l_i)
        acc = tl.where(end[:, None], 0.0, acc)


@triton.jit
def _chunk_out(
    q,
    k_cache,
    v_cache,
    out_ptr,
    lse_ptr,
    table,
    page,
    n,
    j,
    slot,
    chunk,
    kv_end,
    kvh,
    pos,
    q_start,
    tok,
    head,
    row_ok,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    d,
    d_ok,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Chunk j's keys [j * chunk, min((j + 1) * chunk, kv_end)) for the program's rows (n,
    page: its first block's keys and page ids): the output, or with SPLIT the partial output
    and its log-sum-exp in `slot`."""
    lo = j * chunk
    hi = tl.minimum(lo + chunk, kv_end)
    m_i, l_i, acc = _attend_chunk(
        q,
        k_cache,
        v_cache,
        table,
        page,
        n,
        lo,
        hi,
        kvh,
        pos,
        stride_cp,
        stride_cs,
        stride_ch,
        d,
        d_ok,
        qk_scale,
        BLOCK_M,
        BLOCK_D,
        PAGE_SIZE,
        BLOCK_N,
        PREFETCH,
    )
    store_chunk(
        out_ptr,
        lse_ptr,
        m_i,
        l_i,
        acc,
        slot,
        q_start,
        tok,
        head,
        row_ok,
        d,
        d_ok,
        stride_os,
        stride_ot,
        stride_oh,
        stride_ls,
        stride_lt,
        SPLIT,
    )


@triton.jit
def store_chunk(
    out_ptr,
    lse_ptr,
    m_i,
    l_i,
    acc,
    slot,
    q_start,
    tok,
    head,
    row_ok,
    d,
    d_ok,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    SPLIT: tl.constexpr,
):
    """A chunk's normalized output for the program's rows: with SPLIT in fp32 to `slot`
    with its log-sum-exp (both attention kernels' partials), else as the output."""
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = slot * stride_os + (q_start + tok)[:, None] * stride_ot
    o_off += head[:, None] * stride_oh + d[None, :]
    o_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        tl.store(out_ptr + o_off, out, mask=o_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        l_off = slot * stride_ls + (q_start + tok) * stride_lt + head
        tl.store(lse_ptr + l_off, lse, mask=row_ok)
    else:
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _attend_chunk(
    q,
    k_cache,
    v_cache,
    table,
    page,
    n,
    lo,
    hi,
    kvh,
    pos,
    stride_cp,
    stride_cs,
    stride_ch,
    d,
    d_ok,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Online softmax of the rows of q over keys [lo, hi) (n: the first block's keys, page:
    their page ids): (row max, row sum, unnormalized output)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_ok = n < hi
    if PREFETCH:  # K/V of this block in registers, the next block's page ids in flight
        k, v = _kv_load(
            k_cache,
            v_cache,
            page,
            n,
            n_ok,
            kvh,
            stride_cp,
            stride_cs,
            stride_ch,
            d,
            d_ok,
            PAGE_SIZE,
        )
        page = tl.load(table + (n + BLOCK_N) // PAGE_SIZE, mask=n + BLOCK_N < hi, other=0)
    for _ in range(lo, hi, BLOCK_N):
        n_next = n + BLOCK_N
        ok_next = n_next < hi
        if PREFETCH:  # the next block's K/V load while this block is computed
            k_next, v_next = _kv_load(
                k_cache,
                v_cache,
                page,
                n_next,
                ok_next,
                kvh,
                stride_cp,
                stride_cs,
                stride_ch,
                d,
                d_ok,
                PAGE_SIZE,
            )
            page = tl.load(
                table + (n_next + BLOCK_N) // PAGE_SIZE, mask=n_next + BLOCK_N < hi, other=0
            )
            m_i, l_i, acc = _attend_block(q, k, v, n, n_ok, pos, m_i, l_i, acc, qk_scale)
            k, v = k_next, v_next
        else:  # K and V requested together, the next page ids alongside
            k, v = _kv_load(
                k_cache,
                v_cache,
                page,
                n,
                n_ok,
                kvh,
                stride_cp,
                stride_cs,
                stride_ch,
                d,
                d_ok,
                PAGE_SIZE,
            )
            page = tl.load(table + n_next // PAGE_SIZE, mask=ok_next, other=0)
            m_i, l_i, acc = _attend_block(q, k, v, n, n_ok, pos, m_i, l_i, acc, qk_scale)
        n, n_ok = n_next, ok_next
    return m_i, l_i, acc
