"""Triton RMSNorm kernels: the norm alone, the residual add fused into it, and the split-K
GEMV's second pass fused with both (for a projection whose output goes straight into an
add + RMSNorm, as a decoder layer's down projection does).

The numerics follow layers/norm.py's RMSNorm (fp32 statistics, the normed value rounded to
the activation dtype before the weight multiply; the residual add rounded as `x + r`
rounds). The fused split-K kernel gives the same bits as the separate kernels: its first
part is the GEMV's second pass (`gemv.split_k_sum`, the same sum in the same order), whose
row it writes where the separate pass would write it; after a barrier, the row is read
back and normed by the code the add + RMSNorm kernel runs (`_add_rms_norm_row`), so the
norm's reduction is laid out, and ordered, as in that kernel (the row kept in registers
instead would inherit the fp32 partial sums' layout, and sum its squares in another order).

Imported lazily, like the other kernel modules (TRITON_INTERPRET is read when kernels are
defined).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl
from specserve.kernels.gemv import SplitKSum, split_k_sum
from specserve.kernels.pdl_kernel import pdl_enter


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_o,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        pdl_enter()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF: cast before weight
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _add_rms_norm_row(x_row, r_row, w_ptr, sum_row, out_row, n_cols, eps, BLOCK: tl.constexpr):
    """One row: sum = x + r (rounded as `x + r` rounds) and out = rms_norm(sum)."""
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    dtype = sum_row.dtype.element_ty
    x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(r_row + cols, mask=ok, other=0.0).to(tl.float32)
    total = (x + r).to(dtype)  # the residual stream
    tl.store(sum_row + cols, total, mask=ok)
    t = total.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(t * t, 0) / n_cols + eps)
    y = (t * inv_rms).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_row + cols, (y * w).to(out_row.dtype.element_ty), mask=ok)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    sum_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_s,
    stride_o,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        pdl_enter()
    row = tl.program_id(0)
    _add_rms_norm_row(
        x_ptr + row * stride_x,
        r_ptr + row * stride_r,
        w_ptr,
        sum_ptr + row * stride_s,
        out_ptr + row * stride_o,
        n_cols,
        eps,
        BLOCK,
    )


@triton.jit(do_not_specialize=["split_k", "stride_ps"])  # stride_ps = rows x N
def _split_k_add_rms_norm_kernel(
    part_ptr,
    b_ptr,
    y_ptr,
    r_ptr,
    w_ptr,
    sum_ptr,
    out_ptr,
    split_k,
    stride_ps,
    stride_pm,
    stride_y,
    stride_r,
    stride_s,
    stride_o,
    n_cols,
    eps,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        pdl_enter()
    row = tl.program_id(0)
    n = tl.arange(0, BLOCK)
    ok = n < n_cols
    y = split_k_sum(part_ptr + row * stride_pm, b_ptr, n, ok, split_k, stride_ps, HAS_BIAS)
    y_row = y_ptr + row * stride_y
    tl.store(y_row + n, y.to(y_ptr.dtype.element_ty), mask=ok)  # the GEMV's output row
    tl.debug_barrier()  # written by every thread of the program, read back by others
    _add_rms_norm_row(
        y_row,
        r_ptr + row * stride_r,
        w_ptr,
        sum_ptr + row * stride_s,
        out_ptr + row * stride_o,
        n_cols,
        eps,
        BLOCK,
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(n: int) -> dict:
    """A whole row per program: the block and warps every norm kernel uses for n columns
    (the fused kernel must match the add + RMSNorm kernel's, which orders its reduction)."""
    block = triton.next_power_of_2(n)
    return dict(BLOCK=block, num_warps=min(16, max(1, block // 256)))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim, with RMSNorm's rounding; into `out` (2-D,
    x's rows, unit column stride: e.g. one half of a wider buffer) when given."""
    x2 = _rows(x)
    if out is None:
        out = torch.empty(x2.shape, dtype=torch.result_type(x, weight), device=x.device)
    elif out.shape != x2.shape or out.stride(-1) != 1:
        raise ValueError(f"rms_norm: out {tuple(out.shape)} for rows {tuple(x2.shape)}")
    n = x2.shape[-1]
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            weight,
            out,
            x2.stride(0),
            out.stride(0),
            n,
            eps,
            **_launch(n),
            **pdl.launch_options(x.device),
        )
    return out if out.dim() == x.dim() else out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + residual, rms_norm(x + residual)) in one kernel: the residual add of a decoder
    layer fused into the RMSNorm that follows it."""
    x2, r2 = _rows(x), _rows(residual)
    total = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x2.shape, dtype=torch.result_type(x, weight), device=x.device)
    n = x2.shape[-1]
    if x2.shape[0]:
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            total,
            out,
            x2.stride(0),
            r2.stride(0),
            total.stride(0),
            out.stride(0),
            n,
            eps,
            **_launch(n),
            **pdl.launch_options(x.device),
        )
    return total.view(x.shape), out.view(x.shape)


def split_k_add_rms_norm(x: SplitKSum, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """add_rms_norm(x.reduce(), residual, ...) in one kernel, for x the unreduced partial
    sums of a split-K GEMV: the GEMV's second pass, the residual add and the norm, with the
    same results (x.out receives the GEMV's output too)."""
    y, part = x.out, x.partials
    r2 = _rows(residual)
    if r2.shape != y.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match {x.shape}")
    total = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    out = torch.empty(y.shape, dtype=torch.result_type(y, weight), device=y.device)
    n = y.shape[-1]
    if y.shape[0]:
        _split_k_add_rms_norm_kernel[(y.shape[0],)](
            part,
            x.bias if x.bias is not None else part,
            y,
            r2,
            weight,
            total,
            out,
            part.shape[0],
            part.stride(0),
            part.stride(1),
            y.stride(0),
            r2.stride(0),
            total.stride(0),
            out.stride(0),
            n,
            eps,
            HAS_BIAS=x.bias is not None,
            **_launch(n),
            **pdl.launch_options(y.device),
        )
    return total.view(x.shape), out.view(x.shape)
