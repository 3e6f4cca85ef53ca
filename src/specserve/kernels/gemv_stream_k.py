"""Stream-K schedule of the GEMV (`GemvConfig.stream_k`): for the taller row blocks, where a
projection's output tiles do not divide into whole waves of the GPU's multiprocessors (the
8B qkv at 64 rows: 96 tiles of 64 columns on 132 multiprocessors; gate/up: 224), one
program per multiprocessor takes an equal share of all (tile, K block) units, in order.

A tile whose K blocks fall to one program is finished there. A tile split between programs
gets each one's fp32 partial sums in a workspace (a program holds at most two such pieces:
its first tile and its last); each then counts itself in on the tile's counter, and the
program that arrives last, whichever it is, adds the pieces in K order (the same sum on
every run, whoever finishes first), runs the epilogue (bias; the gated SiLU-and-mul of a
merged gate/up weight, whose pieces hold both halves) and puts the counter back to zero
for the next call. The SiLU prologue of a fused down projection runs
as in gemv.py. No program waits for another, so no schedule can
deadlock, and under the interpreter (programs one after another) the last program finishes
every split tile. The counters live in one fixed buffer per device that the kernel keeps at
zero; kernels of a device run one after another (the engine's one stream; under PDL a
kernel touches memory only once the one before has completed), so they share it.

Results are not bitwise those of the data-parallel tile (a split tile's sum is grouped by
piece), so stream-K serves only row buckets above SHARED_ROWS, whose choice is their own.
Imported lazily with gemv.py (kernels are defined at import).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from specserve.kernels.gemv import (  # gemv.py imports this module when first needed
    PDL_PREFETCH_BYTES,
    PDL_PREFETCH_MAX_LINES,
    _load_x,
    _mac,
    silu_mul,
)
from specserve.kernels.gemv_configs import GemvConfig
from specserve.kernels.pdl_kernel import pdl_enter, prefetch_l2

_COUNTERS: dict[torch.device, torch.Tensor] = {}  # per device, kept at zero by the kernel
MAX_TILES = 1 << 16  # counters per device (256 KiB): lm_head at 64 rows has ~2,000 tiles


@triton.jit
def _tile_rows_cols(t, num_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile t's rows m and columns n (the M blocks of one weight tile are neighbours)."""
    m = (t % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = (t // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    return m, n


@triton.jit(do_not_specialize=["M", "units"])
def _gemv_stream_k_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    units,
    iters,
    num_m,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    GATED: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,
):
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    start = p * units // programs
    end = (p + 1) * units // programs
    first_tile = start // iters
    kk = tl.arange(0, BLOCK_K)
    if USE_PDL:
        if PREFETCH > 0:  # weights are read-only: the first lines of the first tile's slice
            _, n0 = _tile_rows_cols(first_tile, num_m, BLOCK_M, BLOCK_N)
            line = tl.arange(0, PREFETCH) * (1024 // w_ptr.dtype.element_ty.primitive_bitwidth)
            k0 = (start - first_tile * iters) * BLOCK_K
            row0 = tl.minimum(n0, N - 1).to(tl.int64)[:, None]
            col0 = tl.minimum(k0 + line, K - 1)[None, :]
            prefetch_l2(w_ptr + row0 * stride_wn + col0)
            if GATED:
                prefetch_l2(w_ptr + (row0 + N) * stride_wn + col0)
        pdl_enter()  # before the first read of x and the first write
    # one pass per tile this program touches (its first and last may be pieces); the inner
    # K loop alone, loads and products, is what the software pipeline overlaps
    for t in range(first_tile, (end + iters - 1) // iters):
        k_lo = tl.maximum(start - t * iters, 0)
        k_hi = tl.minimum(end - t * iters, iters)
        m, n = _tile_rows_cols(t, num_m, BLOCK_M, BLOCK_N)
        m_ok = (m < M)[:, None]
        x_rows = x_ptr + m[:, None] * stride_xm
        w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn
        u_rows = w_ptr + (tl.minimum(n, N - 1) + N).to(tl.int64)[:, None] * stride_wn  # GATED
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # GATED: the up half's sums
        for ki in range(k_lo, k_hi):
            k = ki * BLOCK_K + kk
            if EVEN_K:
                w = tl.load(w_rows + k[None, :])
                x = _load_x(x_rows, k, m_ok, K, SILU)
            else:
                w = tl.load(w_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
                x = _load_x(x_rows, k, m_ok & (k < K)[None, :], K, SILU)
            acc = _mac(acc, x, w, True, IEEE)
            if GATED:
                if EVEN_K:
                    w_u = tl.load(u_rows + k[None, :])
                else:
                    w_u = tl.load(u_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
                acc_u = _mac(acc_u, x, w_u, True, IEEE)
        if (k_lo == 0) & (k_hi == iters):  # the whole tile: finished here
            _finish(acc, acc_u, m, n, M, N, b_ptr, out_ptr, stride_om, HAS_BIAS, GATED)
        else:
            _piece(
                acc,
                acc_u,
                p,
                t,
                first_tile,
                units,
                iters,
                programs,
                m,
                n,
                M,
                N,
                b_ptr,
                out_ptr,
                ws_ptr,
                cnt_ptr,
                stride_om,
                HAS_BIAS,
                BLOCK_M,
                BLOCK_N,
                GATED,
            )


@triton.jit
def _finish(
    acc, acc_u, m, n, M, N, b_ptr, out_ptr, stride_om, HAS_BIAS: tl.constexpr, GATED: tl.constexpr
):
    """A tile's whole sums: bias, rounding (GATED: as the [gate | up] output, then as
    silu_and_mul rounds), and the store."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_ptr + N + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    y = acc.to(out_ptr.dtype.element_ty)
    if GATED:
        y = silu_mul(y, acc_u.to(out_ptr.dtype.element_ty), out_ptr.dtype.element_ty)
    ok = (m < M)[:, None] & (n < N)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], y, mask=ok)


@triton.jit
def _piece(
    acc,
    acc_u,
    p,
    t,
    first_tile,
    units,
    iters,
    programs,
    m,
    n,
    M,
    N,
    b_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GATED: tl.constexpr,
):
    """Program p's piece of split tile t: its partial sums (GATED: both halves') to the
    workspace, its count on the tile's counter; the last to count sums every piece in K
    order and finishes."""
    cells = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_cells = BLOCK_M * BLOCK_N
    piece_cells = tile_cells * (2 if GATED else 1)
    slot = tl.where(t == first_tile, 0, 1)
    own = ws_ptr + (p * 2 + slot).to(tl.int64) * piece_cells + cells
    tl.store(own, acc)
    if GATED:
        tl.store(own + tile_cells, acc_u)
    tl.debug_barrier()  # every thread's partial sums written before the count (release)
    lo = ((t * iters + 1) * programs - 1) // units  # the programs holding tile t's K blocks
    hi = ((t * iters + iters) * programs - 1) // units
    arrived = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
    if arrived == hi - lo:  # the last of them: every other piece is written
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        total_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for q in range(lo, hi + 1):
            q_first = (q * units // programs) // iters
            q_slot = tl.where(t == q_first, 0, 1)
            piece = ws_ptr + (q * 2 + q_slot).to(tl.int64) * piece_cells + cells
            # past L1 (another multiprocessor wrote it), in K order: the same sum every run
            total += tl.load(piece, cache_modifier=".cg")
            if GATED:
                total_u += tl.load(piece + tile_cells, cache_modifier=".cg")
        _finish(total, total_u, m, n, M, N, b_ptr, out_ptr, stride_om, HAS_BIAS, GATED)
        tl.atomic_xchg(cnt_ptr + t, 0, sem="relaxed", scope="gpu")  # ready for the next call


def counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's tile counters (MAX_TILES, zeroed once, kept at zero by the kernel; never
    replaced, since captured CUDA graphs hold their address)."""
    if tiles > MAX_TILES:
        raise ValueError(f"a stream-K GEMV of {tiles} tiles exceeds {MAX_TILES} counters")
    buf = _COUNTERS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a captured zero-fill would run only on replays: eager calls would find garbage
            raise RuntimeError("run a stream-K GEMV eagerly once before capturing one")
        buf = _COUNTERS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return buf


def prefetch_lines(cfg: GemvConfig, programs: int = 132) -> int:
    """128-byte lines of each weight row a program asks L2 for before its PDL wait: the
    GEMV's budget (PDL_PREFETCH_BYTES over all programs' rows; `programs`: about an H200's
    multiprocessor count, a size, not a correctness matter), as a power of 2; from the
    program's first K block on (past its own units, the next program's lines). It depends
    on the tile alone: one compiled variant per tile."""
    lines = min(PDL_PREFETCH_BYTES // (programs * cfg.block_n * 128), PDL_PREFETCH_MAX_LINES)
    return 1 << (lines.bit_length() - 1) if lines >= 1 else 0


@functools.cache
def num_programs(device: torch.device) -> int:
    """One program per multiprocessor (4 under the interpreter on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def launch(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: GemvConfig,
    out: torch.Tensor,
    silu: bool,
    gated: bool,
    consts: dict,
    compile_only: bool,
) -> None:
    """Run (or compile only) the stream-K kernel for x2 [rows, K or 2K with silu] @ weight^T
    (gated: a [gate; up] weight, silu(gate) * up) into out: `consts` carries the launch's
    PDL keywords."""
    rows, (n, k) = x2.shape[0], weight.shape
    n = n // 2 if gated else n
    num_m = triton.cdiv(rows, cfg.block_m)
    iters = triton.cdiv(k, cfg.block_k)
    tiles = num_m * triton.cdiv(n, cfg.block_n)
    units = tiles * iters
    grid = (min(num_programs(x2.device), units),)
    if compile_only:  # stand-ins of the same types (selection compiles from several threads)
        work = torch.empty(1, dtype=torch.float32, device=x2.device)
        count = torch.empty(1, dtype=torch.int32, device=x2.device)
    else:
        work = torch.empty(
            (grid[0] * 2, (2 if gated else 1) * cfg.block_m * cfg.block_n),
            dtype=torch.float32,
            device=x2.device,
        )
        count = counters(x2.device, tiles)
    args = (
        x2,
        weight,
        bias if bias is not None else weight,
        out,
        work,
        count,
        rows,
        n,
        k,
        units,
        iters,
        num_m,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
    )
    if consts.get("USE_PDL"):
        consts = dict(consts, PREFETCH=prefetch_lines(cfg))
    consts = dict(
        consts,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        IEEE=x2.dtype == torch.float32,
        EVEN_K=k % cfg.block_k == 0,
        HAS_BIAS=bias is not None,
        SILU=silu,
        GATED=gated,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if compile_only:
        _gemv_stream_k_kernel.warmup(*args, grid=grid, **consts)
    else:
        _gemv_stream_k_kernel[grid](*args, **consts)
