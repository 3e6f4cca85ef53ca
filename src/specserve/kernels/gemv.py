"""A Triton GEMV / skinny GEMM for decode-sized inputs: y[M, N] = x[M, K] @ W[N, K]^T with
M <= 64 rows, W row-major as nn.Linear stores it, fp32 accumulation, output in x's dtype.

At decode batch sizes a projection mostly streams its weight once; what matters is keeping
enough bytes in flight on every multiprocessor. A program owns BLOCK_M rows, BLOCK_N output
columns and one of `split_k` slices of the K axis. Two inner products:

- `use_dot`: [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tile products on the matrix units
  (BLOCK_M 16, 32 or 64; input rows past M are zeros, never fetched); the loads feed the
  software pipeline (`num_stages`). When M exceeds BLOCK_M a program takes up to 4 row
  blocks (`ROW_BLOCKS`, gemv_configs.row_blocks), one tile product each with the weight
  tile loaded once: each block's sums are those of a one-block program, so a 16-row tile
  gives a verify step's 64 rows the bits of its requests' decode rows without re-reading
  the weight; further row blocks are neighbouring programs (the weight's second read
  comes from L2).
- otherwise: broadcast multiply-adds on the CUDA cores over next_power_of_2(M) rows (one
  compiled variant per row count), each thread keeping its partial products until a single
  reduction after the loop; for M of 1 or 2.

Weight tiles of the matrix-unit path come through pointer loads or (`tma`) a host-built
tensor descriptor, fetched by Hopper's copy engine (rows past N and columns past K read as
zeros): a candidate for the 64-row GEMMs where pointer loads stay near 3 TB/s; not proposed
at start-up until a sweep shows it winning.

With split_k > 1 each slice writes fp32 partial sums to a workspace and a second kernel adds
them in a fixed order: results are bitwise reproducible run to run (no atomics), and the
launch shape and workspace size depend only on (M, N, split_k), so calls are CUDA-graph safe.
A caller that feeds the result to an RMSNorm with residual may take the partial sums
unreduced (`defer_reduce`: a `SplitKSum`); the norm then runs the second pass, the residual
add and the norm in one kernel (triton_norm.py), with the same results.

Fused prologue (`silu`): x may be the [gate | up] output of a merged gate/up projection, the
kernel then multiplies silu(gate) * up, rounded exactly as the separate SiLU-and-mul kernel
rounds (`silu_mul`, shared by both), so results equal that kernel followed by the GEMV.

Fused epilogue (`gated`): the weight is a merged [gate; up] projection, each program
streams the same block_n rows of both halves and stores silu(gate) * up, rounded as the
plain product then SiLU-and-mul round, so results equal that pair of kernels with the same
tile; the [gate | up] output is never written (the MLP's path where the down projection
takes no prologue, as at 64 rows, where the prologue's per-program SiLU is costly).

Fused epilogue (`rope`, gemv_rope.py): the weight is a [q; k; v] projection; each program
computes BLOCK_N columns of one head laid out as rotary pairs, rotates q and k at their
rows' positions and stores q to its own output and k and v straight into the paged KV cache
at their rows' slots: results equal the plain GEMV with the same tile followed by
`rotary_store_kv`, and the qkv output is never written. Matrix-unit tiles of up to 16 rows
only (`rope_fits` says why).

Programmatic dependent launch (kernels/pdl.py): each program first asks L2 for the first
lines of its weight slice (`PREFETCH`, weights are never written while serving), then waits
for the previous kernel, so the weight stream starts during that kernel's tail.

Which configuration (or cuBLAS) serves a shape is measured on the device at start-up
(`gemv_select.py`); `candidate_configs` (gemv_configs.py) only proposes the tiles that won
somewhere in a sweep of tiles on the H200. Imported lazily: kernels are
defined at first import, which is when TRITON_INTERPRET is read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl
from specserve.kernels.gemv_configs import (  # noqa: F401 (also importable from here)
    FMA_MAX_ROWS,
    MAX_ROWS,
    GemvConfig,
    candidate_configs,
    row_block,
    row_blocks,
)
from specserve.kernels.gemv_rope import (  # noqa: F401 (RopeStore, rope_fits: also from here)
    RopeStore,
    rope_args,
    rope_fits,
)
from specserve.kernels.gemv_split_k import (  # noqa: F401 (SplitKSum, split_k_sum: from here)
    SplitKSum,
    _gemv_split_k_reduce_kernel,
    _reduce_launch,
    split_k_sum,
)
from specserve.kernels.gemv_tile import (  # noqa: F401 (silu_mul, _load_x: also from here)
    _finish,
    _load_rows,
    _load_x,
    _mac,
    _w_tile,
    silu_mul,
)
from specserve.kernels.pdl_kernel import pdl_enter, prefetch_l2

# Under PDL, the weight bytes one GEMV asks L2 for before it waits for the previous kernel,
# over all its programs (a fraction of the H200's 50 MB L2, about what streams in during a
# small kernel's few microseconds), and the most 128-byte lines per weight row and program.
PDL_PREFETCH_BYTES = 8 << 20
PDL_PREFETCH_MAX_LINES = 16


# Integers that change with the call (row count, K slice, the partial sums' split stride of
# rows x N) are not specialized on: M = 1 would otherwise compile a variant of its own; nor
# are the rope epilogue's positions and slots (views into the step's one upload, aligned or
# not, runtime/packing.py) and page size (start-up compiles its variants on stand-ins).
@triton.jit(
    do_not_specialize=["M", "iters_per_split", "stride_os", "pos_ptr", "slot_ptr", "page_size"]
)
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    iters_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    SILU: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,
    w_desc=None,
    TMA: tl.constexpr = False,
    GATED: tl.constexpr = False,
    pos_ptr=None,
    slot_ptr=None,
    cos_sin_ptr=None,
    k_cache=None,
    v_cache=None,
    stride_cs=0,
    stride_page=0,
    stride_slot=0,
    page_size=1,
    ROPE: tl.constexpr = False,
    HEAD_DIM: tl.constexpr = 0,
    Q_HEADS: tl.constexpr = 0,
    K_HEADS: tl.constexpr = 0,
    ROW_BLOCKS: tl.constexpr = 1,
):
    tl.static_assert(ROW_BLOCKS == 1 or ROW_BLOCKS == 2 or ROW_BLOCKS == 4)
    pid_m = tl.program_id(0)  # fastest: the row blocks of one weight tile run together
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    # ROW_BLOCKS blocks of BLOCK_M rows per program, each its own tile product with the
    # weight tile loaded once: each row block's sums are those of a BLOCK_M-row program
    m = pid_m * (BLOCK_M * ROW_BLOCKS) + tl.arange(0, BLOCK_M)
    if ROPE:  # one head's rotary pairs side by side: columns j + c and j + c + HEAD_DIM / 2
        head = pid_n // (HEAD_DIM // BLOCK_N)
        j = (pid_n % (HEAD_DIM // BLOCK_N)) * (BLOCK_N // 2)
        c = tl.arange(0, BLOCK_N)
        n = head * HEAD_DIM + j + c // 2 + (c % 2) * (HEAD_DIM // 2)
    else:
        head, j = 0, 0
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    # Weight rows past N re-read row N-1 (discarded at the store): no mask on the streamed
    # loads. Input rows past M are masked (zero-filled, not fetched).
    x_rows = x_ptr + m[:, None] * stride_xm
    step = BLOCK_M * stride_xm  # from one row block to the next
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn
    u_rows = w_ptr + (tl.minimum(n, N - 1) + N).to(tl.int64)[:, None] * stride_wn  # GATED: up
    # Slices start at multiples of BLOCK_K (which the compiler sees: aligned vector loads).
    k_lo = pid_s * iters_per_split * BLOCK_K
    iters = tl.minimum(iters_per_split, tl.cdiv(K - k_lo, BLOCK_K))
    if USE_PDL:  # weights are read-only: their first lines stream in while we wait
        if PREFETCH > 0:
            line = tl.arange(0, PREFETCH) * (1024 // w_ptr.dtype.element_ty.primitive_bitwidth)
            prefetch_l2(w_rows + tl.minimum(k_lo + line, K - 1)[None, :])
            if GATED:
                prefetch_l2(u_rows + tl.minimum(k_lo + line, K - 1)[None, :])
        pdl_enter()  # before the first read of x and the first write
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:  # per-thread partial products, summed over K once after the loop
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    # the further row blocks' sums (ROW_BLOCKS > 1) and GATED's up half's, per row block
    acc1, acc2, acc3 = acc, acc, acc
    acc_u, acc_u1, acc_u2, acc_u3 = acc, acc, acc, acc
    X_IN_BLOCKS: tl.constexpr = EVEN_K and not TMA  # x loads without a column mask
    for i in range(0, iters):
        k = k_lo + i * BLOCK_K + kk
        # TMA: the copy engine fetches the tile; columns past K and rows past the weight read
        # as zeros (a gated gate tile's rows past N read up rows, discarded at the store)
        w = _w_tile(w_rows, w_desc, pid_n * BLOCK_N, k_lo + i * BLOCK_K, k, K, TMA, EVEN_K)
        x = _load_rows(x_rows, k, m < M, K, SILU, X_IN_BLOCKS)
        acc = _mac(acc, x, w, USE_DOT, IEEE)
        if ROW_BLOCKS > 1:
            x1 = _load_rows(x_rows + step, k, m + BLOCK_M < M, K, SILU, X_IN_BLOCKS)
            acc1 = _mac(acc1, x1, w, USE_DOT, IEEE)
        if ROW_BLOCKS > 2:
            x2 = _load_rows(x_rows + 2 * step, k, m + 2 * BLOCK_M < M, K, SILU, X_IN_BLOCKS)
            acc2 = _mac(acc2, x2, w, USE_DOT, IEEE)
            x3 = _load_rows(x_rows + 3 * step, k, m + 3 * BLOCK_M < M, K, SILU, X_IN_BLOCKS)
            acc3 = _mac(acc3, x3, w, USE_DOT, IEEE)
        if GATED:
            w = _w_tile(u_rows, w_desc, N + pid_n * BLOCK_N, k_lo + i * BLOCK_K, k, K, TMA, EVEN_K)
            acc_u = _mac(acc_u, x, w, USE_DOT, IEEE)
            if ROW_BLOCKS > 1:
                acc_u1 = _mac(acc_u1, x1, w, USE_DOT, IEEE)
            if ROW_BLOCKS > 2:
                acc_u2 = _mac(acc_u2, x2, w, USE_DOT, IEEE)
                acc_u3 = _mac(acc_u3, x3, w, USE_DOT, IEEE)
    _finish(
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
        BLOCK_M,
        BLOCK_N,
        USE_DOT,
        HAS_BIAS,
        PARTIAL,
        GATED,
        ROPE,
        HEAD_DIM,
        Q_HEADS,
        K_HEADS,
    )
    if ROW_BLOCKS > 1:
        _finish(
            acc1,
            acc_u1,
            m + BLOCK_M,
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
            BLOCK_M,
            BLOCK_N,
            USE_DOT,
            HAS_BIAS,
            PARTIAL,
            GATED,
            ROPE,
            HEAD_DIM,
            Q_HEADS,
            K_HEADS,
        )
    if ROW_BLOCKS > 2:
        _finish(
            acc2,
            acc_u2,
            m + 2 * BLOCK_M,
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
            BLOCK_M,
            BLOCK_N,
            USE_DOT,
            HAS_BIAS,
            PARTIAL,
            GATED,
            ROPE,
            HEAD_DIM,
            Q_HEADS,
            K_HEADS,
        )
        _finish(
            acc3,
            acc_u3,
            m + 3 * BLOCK_M,
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
            BLOCK_M,
            BLOCK_N,
            USE_DOT,
            HAS_BIAS,
            PARTIAL,
            GATED,
            ROPE,
            HEAD_DIM,
            Q_HEADS,
            K_HEADS,
        )


DEFAULT_CONFIG = GemvConfig(block_n=64, block_k=128)


def _weight_descriptor(weight: torch.Tensor, cfg: GemvConfig):
    """The weight [N, K] as a tensor descriptor of [block_n, block_k] tiles (host-side: a
    CUDA graph keeps it with the launch it captures)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])


def prefetch_lines(cfg: GemvConfig, programs: int, iters_per_split: int, elem_bytes: int) -> int:
    """128-byte lines of each of its weight rows a program asks L2 for before its PDL wait:
    PDL_PREFETCH_BYTES over the kernel's `programs` weight tiles, at most the program's own
    slice and PDL_PREFETCH_MAX_LINES, rounded down to a power of 2 (0: none)."""
    per_row = PDL_PREFETCH_BYTES // (programs * cfg.block_n * 128)
    lines = min(per_row, iters_per_split * cfg.block_k * elem_bytes // 128, PDL_PREFETCH_MAX_LINES)
    return 1 << (lines.bit_length() - 1) if lines >= 1 else 0


def call_prefetch(cfg: GemvConfig, n: int, k: int, elem_bytes: int, gated: bool = False) -> int:
    """The PREFETCH lines (a compile-time constant under PDL) of a call with `cfg` on a
    weight [n, k] (gated: [2n, k], both halves streamed): `prefetch_lines` for the call's
    program count and K slice, as `gemv` launches it (stream-K: its own, by tile)."""
    if cfg.stream_k:
        from specserve.kernels import gemv_stream_k

        return gemv_stream_k.prefetch_lines(cfg)
    iters_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k)
    split_k = triton.cdiv(k, iters_per_split * cfg.block_k)
    programs = triton.cdiv(n, cfg.block_n) * split_k * (1 + gated)
    return prefetch_lines(cfg, programs, iters_per_split, elem_bytes)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig = DEFAULT_CONFIG,
    compile_only: bool = False,
    silu: bool = False,
    defer_reduce: bool = False,
    gated: bool = False,
    rope: RopeStore | None = None,
) -> torch.Tensor | SplitKSum | None:
    """x [..., K] @ weight[N, K]^T (+ bias) for at most MAX_ROWS rows of x; returns [..., N]
    in x's dtype. Allocates only the output (and, with split_k > 1, its fp32 workspace).
    silu: x is [..., 2K], the [gate | up] output of a merged gate/up projection, and the
    product is (silu(gate) * up) @ weight^T, equal to silu_and_mul followed by gemv.
    defer_reduce: with a K split, return the partial sums as a SplitKSum instead of running
    the second pass (for an RMSNorm with residual to run it fused).
    gated: weight is a merged [gate; up] projection [2N, K] and the result silu(x @ gate^T)
    * (x @ up^T) [..., N], equal to silu_and_mul of the plain product's halves; each
    program streams block_n rows of both halves, so `config` must not split K.
    rope: weight is a [q; k; v] projection of the caches' heads; k and v are rotated and
    stored into rope's caches, and the result is the rotated q [..., q_heads, D], equal to
    the plain product followed by triton_rotary.rotary_store_kv; `config` must fit
    (`rope_fits`).
    compile_only: compile the kernels this call needs without running them (returns None;
    safe from several threads at once: start-up selection compiles in parallel)."""
    n, k = weight.shape
    if gated:
        if silu or n % 2:
            raise ValueError("a gated gemv takes x itself and a weight of [gate; up] rows")
        n //= 2
    x_cols = 2 * k if silu else k
    if x.shape[-1] != x_cols:
        raise ValueError(f"gemv needs x with {x_cols} columns for a weight {tuple(weight.shape)}")
    x2 = x.reshape(-1, x_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("gemv needs a weight with contiguous rows")
    rows = x2.shape[0]
    cfg = config
    if rows > cfg.max_rows:
        raise ValueError(f"gemv ({cfg}) serves at most {cfg.max_rows} rows, got {rows}")
    rope_kw = {}
    if rope is not None:
        head_dim = rope.k_cache.shape[3]
        if silu or gated or not rope_fits(cfg, head_dim, k):
            raise ValueError(f"gemv ({cfg}) cannot run the rope epilogue for heads of {head_dim}")
        rope_kw = rope_args(rope, n, head_dim)
        out = torch.empty((rows, rope.q_heads * head_dim), dtype=x.dtype, device=x.device)
        out_shape = (*x.shape[:-1], rope.q_heads, head_dim)
    else:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        out_shape = (*x.shape[:-1], n)
    if rows == 0:
        return None if compile_only else out.view(out_shape)
    if cfg.stream_k:  # one program per multiprocessor (gemv_stream_k.py)
        from specserve.kernels import gemv_stream_k

        if cfg.tma or not cfg.use_dot:
            raise ValueError(f"gemv ({cfg}): stream-K runs matrix-unit pointer tiles only")
        launch = pdl.launch_options(x.device)
        gemv_stream_k.launch(x2, weight, bias, cfg, out, silu, gated, launch, compile_only)
        return None if compile_only else out.view(out_shape)
    block_m = cfg.block_m if cfg.use_dot else max(1, triton.next_power_of_2(rows))
    iters_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k)
    split_k = triton.cdiv(k, iters_per_split * cfg.block_k)  # no empty slices
    has_bias = bias is not None
    partial = split_k > 1
    if gated and partial:
        raise ValueError(f"a gated gemv needs a configuration that does not split K ({cfg})")
    if partial:
        dst = torch.empty((split_k, rows, n), dtype=torch.float32, device=x.device)
        strides = (dst.stride(1), dst.stride(0))
    else:
        dst, strides = out, (out.stride(0), 0)
    blocks = row_blocks(cfg, rows, x.element_size(), gated, silu)
    grid = (triton.cdiv(rows, block_m * blocks), triton.cdiv(n, cfg.block_n), split_k)
    args = (
        x2,
        weight,
        bias if has_bias else weight,
        dst,
        rows,
        n,
        k,
        iters_per_split,
        x2.stride(0),
        weight.stride(0),
        *strides,
    )
    launch = pdl.launch_options(x.device)
    if launch["USE_PDL"]:
        launch["PREFETCH"] = call_prefetch(cfg, n, k, weight.element_size(), gated)
    consts = dict(
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        USE_DOT=cfg.use_dot,
        IEEE=x.dtype == torch.float32,
        EVEN_K=k % cfg.block_k == 0,
        HAS_BIAS=has_bias and not partial,
        PARTIAL=partial,
        SILU=silu,
        GATED=gated,
        ROW_BLOCKS=blocks,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch,
        **rope_kw,
    )
    if cfg.tma:
        if not cfg.use_dot:
            raise ValueError(f"gemv ({cfg}): tensor-descriptor loads need the matrix-unit path")
        consts.update(w_desc=_weight_descriptor(weight, cfg), TMA=True)
    if compile_only:
        _gemv_kernel.warmup(*args, grid=grid, **consts)
        if partial:
            reduce_grid, reduce_args, reduce_consts = _reduce_launch(dst, bias, out)
            _gemv_split_k_reduce_kernel.warmup(*reduce_args, grid=reduce_grid, **reduce_consts)
        return None
    _gemv_kernel[grid](*args, **consts)
    if partial:
        result = SplitKSum(dst, bias, out, out_shape)
        return result if defer_reduce else result.reduce()
    return out.view(out_shape)
