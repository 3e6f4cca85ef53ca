"""The prologue every PDL-launched kernel of the decode path runs (layers/pdl.py says why,
and the contract it keeps). Kernel code: imported by the kernel modules only, so that it
is defined when they are (TRITON_INTERPRET is read then)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_enter():
    """Wait for the previous kernel (it has completed and its writes are visible), then let
    the next one launch."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
