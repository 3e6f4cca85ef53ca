"""Triton kernels for attention over the paged KV cache, and their launchers (the KV write
lives in triton_kv_write.py).

Two attention kernels share one contract. A program owns one request, one KV head and a
block of query *rows*, a row being one (token, query head) pair of that KV head's group:
decode with GQA fills the matrix units with the group's heads, verify with K+1 tokens times
the group, and each K/V block is read once for all of them. `_paged_attn_kernel` serves
every step (prefill, chunked extend, decode, verify); `_paged_attn_decode_kernel`
(triton_decode.py) serves steps of at most DECODE_MAX_ROWS rows per request (decode and
verify: one row block) and is built for bandwidth. The KV length of each request may be
cut into `chunk_splits` chunks (flash-decoding), which `num_splits` programs per (request,
KV head) take in turn, each chunk's partial output written with its log-sum-exp, and a
second kernel merges them in chunk order; the chunk size is computed on the device from the
request's own length, so the launch shape does not depend on the data (CUDA-graph safe),
and a row's bits do not depend on the program count (the backend's batch invariance).
Every kernel here may be launched with programmatic dependent launch (kernels/pdl.py): it
waits for the previous kernel before its first read or write.

Imported lazily: kernels are defined when this module is first imported, which is when
TRITON_INTERPRET is read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl
from specserve.kernels.attention.triton_decode import (
    NOT_SPECIALIZED,
    _paged_attn_decode_kernel,
    chunk_len,
    store_chunk,
)
from specserve.kernels.attention.triton_kv_write import (  # noqa: F401 (callers use them here)
    _check_cache,
    check_cache,
    write_kv,
)
from specserve.kernels.pdl_kernel import pdl_enter

LOG2E = 1.4426950408889634
DECODE_MAX_ROWS = 64  # rows per request up to which the split (decode/verify) path is used
MAX_REDUCE_SPLITS = 32  # the reduce kernel is compiled once for up to this many splits
# Which kernel serves decode-like steps: "decode", "prefetch" (the decode kernel loading the
# next K/V block into registers during this one's math) or "generic" (_paged_attn_kernel).
DECODE_KERNEL = "decode"
DECODE_KERNELS = ("decode", "prefetch", "generic")
# The decode kernel's K/V loop is pipelined at least this deep: two K/V buffers, the next
# block in flight while this one is computed (with 2 the pipeliner keeps one buffer and
# issues the next block's loads only after this block's math).
DECODE_MIN_STAGES = 3
# Under PDL the decode kernel reads its metadata before it waits for the kernel before it
# (triton_decode.py; +0.3% at batch 64 on the H200, within the repeats' spread); off for
# A/Bs.
PDL_EARLY_METADATA = True


# Integers that vary from step to step (the page-table width, the split count, the strides
# of the per-split buffers, which scale with the token count) are not specialized on:
# Triton would otherwise compile a new variant when one first turns 1 or a multiple of 16,
# in the middle of serving. Nor are the addresses of the step's metadata: they are views into
# one upload (runtime/packing.py), 16-byte aligned or not with the parity of the token and
# request counts, and each unseen combination would be a new variant (~0.5 s on the GPU);
# they are read as scalars and gathers, which alignment does not speed up.
@triton.jit(do_not_specialize=[*NOT_SPECIALIZED, "tiles_ptr"])
def _paged_attn_kernel(
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
    tiles_ptr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    LOOP: tl.constexpr = False,
    ROW_CHUNKS: tl.constexpr = False,
    TILES: tl.constexpr = False,
):
    # ROW_CHUNKS is the decode kernel's alone (the same contract): here chunks always follow
    # the row block's key range, so a verify step crossing a chunk boundary may round its
    # later rows apart from their decode steps.
    # TILES: program (i, KV head) takes the row block tiles_ptr[i] = (request, block) instead
    # of (block, request x KV head); a request below 0 is no work (the list's padding).
    if USE_PDL:  # kernels/pdl.py
        pdl_enter()
    pid_s = tl.program_id(2)
    if TILES:
        tile = tl.program_id(0)
        b = tl.load(tiles_ptr + 2 * tile)
        pid_m = tl.load(tiles_ptr + 2 * tile + 1)
        live = b >= 0
        b = tl.maximum(b, 0)
        kvh = tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // KV_HEADS
        kvh = pid_bh % KV_HEADS
    q_start = tl.load(query_start_loc + b)
    q_len = tl.load(query_start_loc + b + 1) - q_start
    if TILES:
        q_len = tl.where(live, q_len, 0)
    seq_len = tl.load(seq_lens + b)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < q_len
    pos = tl.load(positions + q_start + tok, mask=row_ok, other=-1)
    # Keys this block can see: up to its last token's position (a request's positions
    # ascend), within the request's length. Empty blocks (last_tok < 0) see nothing.
    last_tok = tl.minimum(q_len - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP)
    last_pos = tl.load(positions + q_start + tl.maximum(last_tok, 0))
    kv_end = tl.where(last_tok >= 0, tl.minimum(seq_len, last_pos + 1), 0)
    chunk = chunk_len(kv_end, chunk_splits, min_chunk, BLOCK_N)
    num_chunks = tl.cdiv(kv_end, chunk)

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_off = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if SPLIT:  # how many partials each row has, for the merge
        if pid_s == 0:
            nc_off = (q_start + tok) * stride_lt + head
            tl.store(nchunk_ptr + nc_off, num_chunks + rows * 0, mask=row_ok)

    if LOOP:  # fewer programs than chunks: chunks j, j + num_splits, ...
        for j in range(pid_s, num_chunks, num_splits):
            _generic_chunk_out(
                q,
                k_cache,
                v_cache,
                out_ptr,
                lse_ptr,
                block_tables,
                b,
                j,
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
                stride_bt,
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
            )
    elif pid_s < num_chunks:  # the program's own chunk (past the request's: none, unmerged)
        _generic_chunk_out(
            q,
            k_cache,
            v_cache,
            out_ptr,
            lse_ptr,
            block_tables,
            b,
            pid_s,
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
            stride_bt,
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
        )


@triton.jit
def _generic_chunk_out(
    q,
    k_cache,
    v_cache,
    out_ptr,
    lse_ptr,
    block_tables,
    b,
    j,
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
    stride_bt,
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
):
    """Chunk j's keys for the program's rows: the output, or with SPLIT the partial output
    and its log-sum-exp in slot j."""
    lo = j * chunk
    hi = tl.minimum(lo + chunk, kv_end)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        page = tl.load(block_tables + b * stride_bt + n // PAGE_SIZE, mask=n_ok, other=0)
        kv_off = page * stride_cp + (n % PAGE_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
        visible = (n[None, :] <= pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    store_chunk(
        out_ptr,
        lse_ptr,
        m_i,
        l_i,
        acc,
        j,
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


@triton.jit(do_not_specialize=["stride_ps", "stride_ls", "stride_lt", "num_slots"])
def _split_reduce_kernel(
    part_ptr,
    lse_ptr,
    nchunk_ptr,
    out_ptr,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    stride_ot,
    stride_oh,
    num_slots,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # Row (token t, head h) of a split step: its chunks' partial outputs (nchunk_ptr[t, h] %
    # 256 of them, from slot nchunk_ptr[t, h] // 256 on: the decode kernel's ROW_CHUNKS puts
    # a second chunking after the first) weighed by their log-sum-exp, written to out in its
    # dtype. The
    # chunks are added one after the other in chunk order (unrolled over BLOCK_S, the loads
    # independent of each other; past the row's count they read nothing and weigh 0), so the
    # sum's order depends on neither the program count nor how Triton lays out a tile. The
    # partials are read once, past L1 (.cg).
    if USE_PDL:  # kernels/pdl.py
        pdl_enter()
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse_row = lse_ptr + t * stride_lt + h
    part_row = part_ptr + t * stride_pt + h * stride_ph + d
    code = tl.load(nchunk_ptr + t * stride_lt + h)
    count = tl.minimum(code % 256, BLOCK_S)
    base = tl.minimum(code // 256, num_slots - count)  # (in bounds whatever is there)
    lse_row += base * stride_ls
    part_row += base * stride_ps
    m = tl.full([], float("-inf"), tl.float32)
    for s in tl.static_range(0, BLOCK_S):  # past the count: the last chunk again, unused
        last = tl.maximum(tl.minimum(count - 1, s), 0)
        lse_s = tl.load(lse_row + last * stride_ls, cache_modifier=".cg")
        m = tl.maximum(m, tl.where(s < count, lse_s, float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = m * 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in tl.static_range(0, BLOCK_S):
        last = tl.maximum(tl.minimum(count - 1, s), 0)
        lse_s = tl.load(lse_row + last * stride_ls, cache_modifier=".cg")
        w = tl.where(s < count, tl.exp2(lse_s - m), 0.0)  # empty chunks weigh 0 too
        denom += w
        in_count = d_ok & (d * 0 + s < count)  # (a tensor mask, as the interpreter needs)
        acc += (
            tl.load(part_row + last * stride_ps, mask=in_count, other=0.0, cache_modifier=".cg") * w
        )
    out = acc / tl.where(denom > 0, denom, 1.0)
    # A row without chunks is left alone: another launch's (a mixed step's short rows beside
    # its tiles), or one that `clear` zeroed.
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok & (d * 0 + count > 0),  # (a tensor mask, as the interpreter needs)
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    num_splits: int = 1,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    kernel: str | None = None,
    chunk_splits: int | None = None,
    min_chunk: int | None = None,
    tiles: torch.Tensor | None = None,
    tile_rows: int = 128,
    clear: bool = False,
) -> torch.Tensor:
    """Causal attention of packed queries q [T, H, D] over the paged cache; returns [T, H, D].

    The keys of every request are cut into chunks of ceil(length / chunks) rounded up to
    whole key blocks, num_splits programs per (request, KV head) take them in turn, and a
    second kernel merges the chunks' partial results in chunk order; one chunk writes the
    output directly. By default chunks = num_splits and the length is the request's. Given
    chunk_splits (at least num_splits), chunks = chunk_splits, and the decode kernels chunk
    each row by its own length (position + 1; a step whose rows cross a chunk boundary runs
    both chunkings): a row's bits then depend on its position alone, not on the program
    count, the request count or the tokens verified after it (the generic kernel chunks by
    the request's length); with chunk_splits, `min_chunk` keys (rounded up to whole key
    blocks; default one block) is the shortest chunk, a constant too. block_n (keys per
    iteration), num_warps and num_stages override the tuned defaults (the "decode" kernel
    takes at least DECODE_MIN_STAGES). kernel picks what serves decode-like steps (at most
    DECODE_MAX_ROWS rows per request): one of DECODE_KERNELS, default DECODE_KERNEL; other
    steps always take the generic kernel.

    `tiles` [N, 2] int64 lists the row blocks to compute as (request, block of `tile_rows`
    rows), a request below 0 being none: the generic kernel then runs N programs per KV head
    whatever the requests' lengths (a CUDA graph's fixed grid over a step's prefill chunks;
    rows of requests without a tile are left alone). `clear` zeroes `out` first and the
    split path's per-row chunk counts, so rows that no program writes come out 0 (a graph's
    padding, and rows of requests another launch serves).
    """
    num_tokens, num_heads, head_dim = q.shape
    _check_cache(k_cache, v_cache)
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.zeros_like(q) if clear else torch.empty_like(q)
    elif clear:
        out.zero_()
    num_requests = seq_lens.shape[0]
    if num_tokens == 0 or num_requests == 0:
        return out
    rows = max_query_len * group
    decode_like = rows <= DECODE_MAX_ROWS and tiles is None
    block_m = max(16, triton.next_power_of_2(rows)) if decode_like else 128
    if tiles is not None:
        block_m = tile_rows
    block_n = block_n or 64
    block_d = max(16, triton.next_power_of_2(head_dim))
    num_warps = num_warps or (4 if decode_like else 8)
    chunks = chunk_splits or num_splits
    if chunks < num_splits or chunks > MAX_REDUCE_SPLITS:
        raise ValueError(
            f"chunk_splits ({chunks}) must be within num_splits ({num_splits}) "
            f"and {MAX_REDUCE_SPLITS}"
        )
    grid = (triton.cdiv(rows, block_m), num_requests * kv_heads, num_splits)
    if tiles is not None:
        grid = (tiles.shape[0], kv_heads, num_splits)
    # the shortest chunk in keys, whole blocks (by default chunks of one block are allowed)
    min_keys = triton.cdiv(min_chunk or 1, block_n) * block_n if chunk_splits else block_n
    kernel = kernel or DECODE_KERNEL
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"kernel must be one of {DECODE_KERNELS}, got {kernel!r}")
    decode_kernel = decode_like and kernel != "generic"
    row_chunks = chunk_splits is not None  # rows chunked by their own length: two chunkings
    slots = chunks * (2 if row_chunks and decode_kernel else 1)
    split = chunks > 1 or row_chunks
    if split:
        part = torch.empty(
            (slots, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty((slots, num_tokens, num_heads), dtype=torch.float32, device=q.device)
        # rows that no program writes merge nothing (tiles: the rows of other launches)
        alloc = torch.zeros if clear or tiles is not None else torch.empty
        nchunk = alloc((num_tokens, num_heads), dtype=torch.int32, device=q.device)
        dst, dst_strides, lse_strides = part, part.stride()[:3], lse.stride()[:2]
    else:
        lse, dst = out, out  # lse unused
        nchunk = seq_lens  # unused (an argument already there: no allocation per call)
        dst_strides, lse_strides = (0, *out.stride()[:2]), (0, 0)
    launch_pdl = pdl.launch_options(q.device)
    extra = {}
    if decode_kernel:
        launch, extra["PREFETCH"] = _paged_attn_decode_kernel[grid], kernel == "prefetch"
        extra["EARLY_METADATA"] = PDL_EARLY_METADATA
        if kernel == "decode":
            num_stages = max(num_stages, DECODE_MIN_STAGES)
    else:
        launch = _paged_attn_kernel[grid]
        extra["tiles_ptr"] = seq_lens if tiles is None else tiles  # (unread without tiles)
        extra["TILES"] = tiles is not None
    launch(
        q,
        k_cache,
        v_cache,
        dst,
        lse,
        positions,
        query_start_loc,
        seq_lens,
        block_tables,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        *dst_strides,
        *lse_strides,
        scale * LOG2E,
        num_splits,
        chunks,
        min_keys,
        nchunk,
        KV_HEADS=kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SPLIT=split,
        LOOP=num_splits < chunks,
        ROW_CHUNKS=row_chunks,
        num_warps=num_warps,
        num_stages=num_stages,
        **extra,
        **launch_pdl,
    )
    if split:
        _split_reduce_kernel[(num_tokens, num_heads)](
            part,
            lse,
            nchunk,
            out,
            *part.stride()[:3],
            *lse.stride()[:2],
            *out.stride()[:2],
            slots,
            BLOCK_S=MAX_REDUCE_SPLITS,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            **launch_pdl,
        )
    return out


def decode_num_splits(
    num_programs: int,
    max_seq_len: int,
    num_sms: int,
    programs_per_sm: float = 4,
    min_split_tokens: int = 128,
    max_splits: int = MAX_REDUCE_SPLITS,
) -> int:
    """A split count for a decode-like step of `num_programs` (request, KV head) pairs that
    keeps the programs within one wave (`programs_per_sm` resident per multiprocessor): the
    most splits that still fit, none once the pairs alone fill the wave (a second wave of
    short programs and the merge kernel cost more than the idle slots), and no chunk shorter
    than `min_split_tokens`. The backend's policy (`TritonAttentionBackend.choose_num_splits`)."""
    slots = int(programs_per_sm * num_sms)
    by_length = -(-max_seq_len // min_split_tokens)
    return max(1, min(slots // max(1, num_programs), by_length, max_splits))
