"""A Triton GEMV / skinny GEMM for decode-sized inputs: y[M, N] = x[M, K] @ W[N, K]^T with
M <= 64 rows, W row-major as nn.Linear stores it, fp32 accumulation, output in x's dtype.

At decode batch sizes a projection mostly streams its weight once; what matters is keeping
enough bytes in flight on every multiprocessor. A program owns BLOCK_M rows, BLOCK_N output
columns and one of `split_k` slices of the K axis. Two inner products:

- `use_dot`: [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tile products on the matrix units
  (BLOCK_M 16, 32 or 64; input rows past M are zeros, never fetched); the loads feed the
  software pipeline (`num_stages`), one compiled variant per tile serves every M. When M
  exceeds BLOCK_M the row blocks of one weight tile are neighbouring programs, so the
  weight's second read comes from L2.
- otherwise: broadcast multiply-adds on the CUDA cores over next_power_of_2(M) rows (one
  compiled variant per row count), each thread keeping its partial products until a single
  reduction after the loop; for M of 1 or 2.

With split_k > 1 each slice writes fp32 partial sums to a workspace and a second kernel adds
them in a fixed order: results are bitwise reproducible run to run (no atomics), and the
launch shape and workspace size depend only on (M, N, split_k), so calls are CUDA-graph safe.

Which configuration (or cuBLAS) serves a shape is measured on the device at start-up
(`gemv_select.py`); `candidate_configs` only proposes the tiles that won somewhere in the
H200 sweep (scripts/gpu_kernel_bench.py). Imported lazily: kernels are defined at first
import, which is when TRITON_INTERPRET is read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

MAX_ROWS = 64  # the tallest row block; more rows go to torch
FMA_MAX_ROWS = 8


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration of the GEMV kernel (block_m: rows per program of the
    matrix-unit path; the CUDA-core path uses next_power_of_2(M))."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True
    block_m: int = 16

    def __str__(self) -> str:
        kind = f"dot m{self.block_m}" if self.use_dot else "fma"
        return (f"{kind} n{self.block_n} k{self.block_k} s{self.split_k} "
                f"w{self.num_warps} st{self.num_stages}")  # fmt: skip

    @property
    def max_rows(self) -> int:
        """The most rows of x a call with this configuration takes."""
        return MAX_ROWS if self.use_dot else FMA_MAX_ROWS

    def supports(self, rows: int, n: int, k: int) -> bool:
        """Whether this configuration can serve a [rows, k] x [n, k]^T product sensibly:
        every K slice at least one block long, and few enough rows for its path."""
        if rows > self.max_rows:
            return False
        return self.split_k == 1 or triton.cdiv(k, self.split_k) >= self.block_k


# Integers that change with the call (row count, K slice, the partial sums' split stride of
# rows x N) are not specialized on: M = 1 would otherwise compile a variant of its own.
@triton.jit(do_not_specialize=["M", "iters_per_split", "stride_os"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, iters_per_split,
    stride_xm, stride_wn, stride_om, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)  # fastest: the row blocks of one weight tile run together
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    # Weight rows past N re-read row N-1 (discarded at the store): no mask on the streamed
    # loads. Input rows past M are masked (zero-filled, not fetched).
    m_ok = (m < M)[:, None]
    x_rows = x_ptr + m[:, None] * stride_xm
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn
    # Slices start at multiples of BLOCK_K (which the compiler sees: aligned vector loads).
    k_lo = pid_s * iters_per_split * BLOCK_K
    iters = tl.minimum(iters_per_split, tl.cdiv(K - k_lo, BLOCK_K))
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:  # per-thread partial products, summed over K once after the loop
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in range(0, iters):
        k = k_lo + i * BLOCK_K + kk
        if EVEN_K:  # K is a multiple of BLOCK_K
            w = tl.load(w_rows + k[None, :])
            x = tl.load(x_rows + k[None, :], mask=m_ok, other=0.0)
        else:
            k_ok = (k < K)[None, :]
            w = tl.load(w_rows + k[None, :], mask=k_ok, other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_ok & k_ok, other=0.0)
        if USE_DOT:
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        else:
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not USE_DOT:
        acc = tl.sum(acc, axis=2)
    ok = m_ok & (n < N)[None, :]
    if PARTIAL:
        dst = out_ptr + pid_s * stride_os + m[:, None] * stride_om + n[None, :]
        tl.store(dst, acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        dst = out_ptr + m[:, None] * stride_om + n[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["split_k", "stride_ps"])  # stride_ps = rows x N
def _gemv_split_k_reduce_kernel(
    part_ptr, b_ptr, out_ptr, N, split_k, stride_ps, stride_pm, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, split_k):  # a fixed order: the same sum every run
        acc += tl.load(part_ptr + s * stride_ps + m * stride_pm + n, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


REDUCE_BLOCK = 1024
DEFAULT_CONFIG = GemvConfig(block_n=64, block_k=128)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig = DEFAULT_CONFIG,
    compile_only: bool = False,
) -> torch.Tensor | None:
    """x [..., K] @ weight[N, K]^T (+ bias) for at most MAX_ROWS rows of x; returns [..., N]
    in x's dtype. Allocates only the output (and, with split_k > 1, its fp32 workspace).
    compile_only: compile the kernels this call needs without running them (returns None;
    safe from several threads at once: start-up selection compiles in parallel)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("gemv needs a weight with contiguous rows")
    rows = x2.shape[0]
    cfg = config
    if rows > cfg.max_rows:
        raise ValueError(f"gemv ({cfg}) serves at most {cfg.max_rows} rows, got {rows}")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return None if compile_only else out.view(*x.shape[:-1], n)
    block_m = cfg.block_m if cfg.use_dot else max(1, triton.next_power_of_2(rows))
    iters_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k)
    split_k = triton.cdiv(k, iters_per_split * cfg.block_k)  # no empty slices
    has_bias = bias is not None
    partial = split_k > 1
    if partial:
        dst = torch.empty((split_k, rows, n), dtype=torch.float32, device=x.device)
        strides = (dst.stride(1), dst.stride(0))
    else:
        dst, strides = out, (out.stride(0), 0)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, cfg.block_n), split_k)
    args = (x2, weight, bias if has_bias else weight, dst, rows, n, k, iters_per_split,
            x2.stride(0), weight.stride(0), *strides)  # fmt: skip
    consts = dict(
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot,
        IEEE=x.dtype == torch.float32, EVEN_K=k % cfg.block_k == 0,
        HAS_BIAS=has_bias and not partial, PARTIAL=partial, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    reduce_grid = (rows, triton.cdiv(n, REDUCE_BLOCK))
    reduce_args = (dst, bias if has_bias else dst, out, n, split_k, dst.stride(0), dst.stride(1),
                   out.stride(0))  # fmt: skip
    reduce_consts = dict(HAS_BIAS=has_bias, BLOCK=REDUCE_BLOCK)
    if compile_only:
        _gemv_kernel.warmup(*args, grid=grid, **consts)
        if partial:
            _gemv_split_k_reduce_kernel.warmup(*reduce_args, grid=reduce_grid, **reduce_consts)
        return None
    _gemv_kernel[grid](*args, **consts)
    if partial:
        _gemv_split_k_reduce_kernel[reduce_grid](*reduce_args, **reduce_consts)
    return out.view(*x.shape[:-1], n)


def row_block(rows: int) -> int:
    """The matrix-unit row block that serves `rows` rows in one pass: 16, 32 or 64."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


# The tiles that won somewhere in the H200 sweep of the earlier, larger candidate set (bf16
# and fp16, M 1..8, Llama-3.1-8B / EAGLE-3 / SmolLM2 shapes), per row block; the taller row
# blocks carry the same tile family plus wider ones (every program re-reads its rows of x
# from L2: 512 KB per program at M = 64, K = 4096).
_TILES = {
    16: [GemvConfig(32, 256, num_warps=4, num_stages=4), GemvConfig(64, 128, num_stages=4),
         GemvConfig(128, 128, num_stages=3), GemvConfig(16, 256, num_warps=2, num_stages=5)],
    32: [GemvConfig(32, 256, num_stages=4), GemvConfig(64, 128, num_stages=4),
         GemvConfig(128, 128, num_stages=3), GemvConfig(16, 256, num_warps=2, num_stages=4)],
    64: [GemvConfig(32, 256, num_stages=3), GemvConfig(64, 128, num_stages=4),
         GemvConfig(128, 64, num_stages=4), GemvConfig(128, 128, num_warps=8, num_stages=3),
         GemvConfig(256, 64, num_warps=8, num_stages=3)],  # fewer re-reads of x from L2
}  # fmt: skip
_FMA = GemvConfig(8, 512, num_warps=4, num_stages=2, use_dot=False)
_SPLIT_TILE = GemvConfig(64, 128, num_stages=4)


def candidate_configs(rows: int, n: int, k: int, num_sms: int) -> list[GemvConfig]:
    """The configurations start-up selection times for `rows` rows of a weight [n, k], in
    order of preference on a tie: the CUDA-core product for one or two rows, the unsplit
    tiles of the row block, and, for a long K (K > N: few output tiles, long rows), one
    K split that brings the program count to about one wave of `num_sms`."""
    bm = row_block(rows)
    tiles = ([_FMA] if rows <= 2 else []) + [replace(t, block_m=bm) for t in _TILES[bm]]
    if k > n:
        programs = triton.cdiv(n, _SPLIT_TILE.block_n)
        want = triton.next_power_of_2(triton.cdiv(num_sms, programs))
        split = min(want, 16, k // _SPLIT_TILE.block_k)
        if split > 1:
            tiles.append(replace(_SPLIT_TILE, block_m=bm, split_k=split))
    return [t for t in tiles if t.supports(rows, n, k)]
