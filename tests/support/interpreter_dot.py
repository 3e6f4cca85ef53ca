"""The Triton interpreter's `tl.dot`, made independent of the shape it is called with.

The interpreter computes a dot as numpy's matmul in the accumulator's dtype, and numpy's
float32 matmul (OpenBLAS) rounds differently by shape on some CPUs: with its AVX-512
kernels a row's result depends on how many rows or columns the call has. Kernel cases that
hold two kernels to the same bits (a fused epilogue against the unfused pair, a chunking
against another) then fail on such a machine for reasons that are not the kernels'. Here
a floating-point dot is computed in float64 and rounded once to the accumulator's dtype,
which makes it the same whatever the tile's shape (the products of float32 or narrower
inputs are exact in float64; the sum's error is far below a float32 ulp). Imported by the
interpreter runs' launcher (interpreter_run.py) before any case runs.
"""

from __future__ import annotations

import numpy as np
from triton.runtime import interpreter

_create_dot = interpreter.InterpreterBuilder.create_dot


def _create_dot_f64(self, a, b, d, input_precision, max_num_imprecise_acc):
    acc = d.data
    narrow = 8 in (a.dtype.primitive_bitwidth, b.dtype.primitive_bitwidth)  # (fp8: as before)
    if not np.issubdtype(acc.dtype, np.floating) or narrow:
        return _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    prod = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(acc.dtype)
    return interpreter.TensorHandle(prod + acc, d.dtype.scalar)


interpreter.InterpreterBuilder.create_dot = _create_dot_f64
