"""The prologue every PDL-launched kernel of the decode path runs (kernels/pdl.py says why,
and the contract it keeps), and the L2 prefetch a kernel may issue before its wait. Kernel
code: imported by the kernel modules only, so that it is defined when they are
(TRITON_INTERPRET is read then)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_enter():
    """Wait for the previous kernel (it has completed and its writes are visible), then let
    the next one launch."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines holding `ptrs` (no registers filled, nothing waits for them)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
