"""Batch invariance of the decode-sized linears: greedy speculation is lossless only if a
verify row (a request's K+1 tokens among the step's rows) rounds as the same row of a plain
decode step, so a row's bits must not depend on how many rows share its step. Selection
(gemv_select.py) gives the row buckets up to SHARED_ROWS one shared Triton configuration,
which computes a row alike at every row count; cuBLAS instead picks its kernel, and with it
the reduction order, by the shape (and, with a bias, PyTorch takes another path for one row
than for several), so whether it may serve those buckets is checked here, per weight shape
and bias, once a process: `torch_varies` lists the shapes where it may not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ShapeKey = tuple[int, int, torch.dtype]  # (N, K, dtype) of a weight [N, K]

# (device index, N, K, dtype, has bias, rows) -> whether torch_rows_agree held
_TORCH_ROWS: dict[tuple, bool] = {}


def torch_rows_agree(
    w: torch.Tensor, max_rows: int, bias: torch.Tensor | None = None, linear=F.linear
) -> bool:
    """Whether `linear(x, w, bias)` (torch's) gives every row the same bits at each row count
    1..max_rows, on seeded random rows: two kernels that reduce in different orders round
    some of a random row's outputs apart."""
    gen = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(max_rows, w.shape[1], generator=gen, device=w.device).to(w.dtype)
    full = linear(x, w, bias)
    return all(torch.equal(linear(x[:m], w, bias), full[:m]) for m in range(1, max_rows))


def torch_varies(
    weights: dict[ShapeKey, torch.Tensor], biases: dict[ShapeKey, torch.Tensor], rows: int
) -> frozenset[ShapeKey]:
    """The shapes of `weights` (one weight each) whose torch linear changes a row's bits
    between row counts up to `rows`, checked with the shape's bias where its layers have
    one (`biases`) and without otherwise; each (device, shape, bias, rows) once a process."""
    varies = set()
    for shape, w in weights.items():
        bias = biases.get(shape)
        key = (w.device.index, *shape, bias is not None, rows)
        if key not in _TORCH_ROWS:
            _TORCH_ROWS[key] = rows <= 1 or torch_rows_agree(w, rows, bias)
        if not _TORCH_ROWS[key]:
            varies.add(shape)
    return frozenset(varies)
