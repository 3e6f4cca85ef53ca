"""The split-K GEMV's second pass (gemv.py): each K slice's fp32 partial sums added in a
fixed order (bitwise reproducible, no atomics), then the bias, as a kernel of its own
(`SplitKSum.reduce`) or inside the next RMSNorm with residual (triton_norm.py, which calls
`split_k_sum`). Imported with gemv.py, when kernels may be defined.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl
from specserve.kernels.pdl_kernel import pdl_enter


@triton.jit
def split_k_sum(part_ptr, b_ptr, n, ok, split_k, stride_ps, HAS_BIAS: tl.constexpr):
    """The second pass of a split-K GEMV for columns n of one row (part_ptr at that row):
    the slices' fp32 partial sums in a fixed order (the same sum every run), then the bias."""
    acc = tl.zeros(n.shape, dtype=tl.float32)
    for s in range(0, split_k):
        acc += tl.load(part_ptr + s * stride_ps + n, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["split_k", "stride_ps"])  # stride_ps = rows x N
def _gemv_split_k_reduce_kernel(
    part_ptr,
    b_ptr,
    out_ptr,
    N,
    split_k,
    stride_ps,
    stride_pm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        pdl_enter()
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    acc = split_k_sum(part_ptr + m * stride_pm, b_ptr, n, ok, split_k, stride_ps, HAS_BIAS)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


REDUCE_BLOCK = 1024


@dataclass
class SplitKSum:
    """A split-K GEMV whose second pass has not run yet: the fp32 partial sums [split_k,
    rows, N], the bias, and the output [rows, N] (x's dtype) that the pass fills. `reduce()`
    runs the pass on its own; an RMSNorm with residual runs it fused with the add and the
    norm (triton_norm.split_k_add_rms_norm), writing the same output."""

    partials: torch.Tensor
    bias: torch.Tensor | None
    out: torch.Tensor
    shape: tuple[int, ...]  # the output's shape, [..., N]

    def reduce(self) -> torch.Tensor:
        """The GEMV's output, through the separate second-pass kernel."""
        _split_k_reduce(self.partials, self.bias, self.out)
        return self.out.view(self.shape)


def _reduce_launch(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor):
    n = out.shape[1]
    grid = (out.shape[0], triton.cdiv(n, REDUCE_BLOCK))
    args = (
        partials,
        bias if bias is not None else partials,
        out,
        n,
        partials.shape[0],
        partials.stride(0),
        partials.stride(1),
        out.stride(0),
    )
    consts = dict(HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK, **pdl.launch_options(out.device))
    return grid, args, consts


def _split_k_reduce(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor):
    grid, args, consts = _reduce_launch(partials, bias, out)
    _gemv_split_k_reduce_kernel[grid](*args, **consts)
