"""The prologue every PDL-launched kernel of the decode path runs (layers/pdl.py says why,
and the contract it keeps). Kernel code: imported by the kernel modules only, so that it
is defined when they are (TRITON_INTERPRET is read then)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_enter(EARLY: tl.constexpr):
    """Wait for the previous kernel (it has completed and its writes are visible), and let
    the next one launch: after the wait, or before it with EARLY (pdl.set_early_trigger),
    so that the next kernel's programs can become resident, and a GEMV's weight prefetch
    start, while this kernel still waits."""
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()
    if not EARLY:
        tl.extra.cuda.gdc_launch_dependents()
