"""Programmatic dependent launch (PDL) for this package's Triton kernels, on Hopper and later.

Inside a CUDA graph a decode step is a chain of a few hundred kernels. Normally each one
starts only once the previous one has finished and flushed its writes, so the GPU drains
and refills at every boundary. Launched with PDL (`launch_pdl=True`, the kernel compiled
with `USE_PDL`), a kernel may start as soon as every program of the previous kernel has
called `gdc_launch_dependents()`; its programs then block in `gdc_wait()` until that
kernel has completed and its writes are visible. What a program does before the wait
overlaps the previous kernel's tail: the GEMV prefetches the first tiles of its weight
slice into L2 (weights are never written while serving), the decode attention kernel reads
its metadata (triton_decode.py); the other kernels only get their launch latency hidden.

The contract every kernel launched this way keeps (gemv.py, gemv_split_k.py,
gemv_stream_k.py, triton_norm.py, triton_ops.py, triton_rotary.py, triton_argmax.py,
attention/triton_kernels.py, attention/triton_decode.py, attention/triton_kv_write.py):

- every program calls `gdc_wait()` unconditionally, before its first read of anything an
  earlier kernel may have written and before its first write (an earlier kernel may still
  be reading what it overwrites, e.g. a buffer the allocator has handed out again).
  Exempt: what only work launched without PDL writes (torch ops, copies, and the host
  path's own kernels: runtime/stage_kernel.py, runtime/shift_kernel.py), such as the
  step's attention metadata. A kernel starts only once its predecessor has passed its
  own wait (or, launched without PDL, completed), so all such work launched before it
  has completed by then;
- `gdc_launch_dependents()` right after that wait. A kernel completes only after its
  predecessor has (every program waits), and "completed" holds transitively down the
  chain, so a kernel that waits on its direct predecessor also sees every write before it.

The prologue is one function, `pdl_kernel.pdl_enter`. (Signalling before the wait, so
that the next kernel becomes resident earlier, was measured on the H200 and did not pay.)

Kernels of torch and cuBLAS are launched as usual and need nothing: a PDL kernel after one
of them starts when it ends; a plain launch after a PDL kernel waits for it as always.

Numerics do not change: the kernels run the same loops in the same order; the only
additions are the wait, the launch signal and L2 prefetches.

The switch is `KernelOptions.pdl` (core/kernel_options.py): an engine's from
`EngineConfig.execution.disable_pdl` while its start-up and steps run, else the process
default (`set_enabled`). Launches read it when they are made, so CUDA graphs keep what they
captured. PDL is active only on
CUDA devices of compute capability 9 or more, never under the Triton interpreter (the CPU
tests), and only with a Triton that has `tl.extra.cuda.gdc_wait`.
"""

from __future__ import annotations

import os

import torch

from specserve.core.kernel_options import current, set_default

_capable: dict[int, bool] = {}  # CUDA device index -> whether it and Triton support PDL


def set_enabled(enabled: bool) -> bool:
    """Turn PDL on (where supported) or off for launches from now on outside engines (the
    process default); returns the previous setting. CUDA graphs captured earlier keep the
    launches they captured."""
    return set_default(pdl=bool(enabled)).pdl


def is_enabled() -> bool:
    """The switch in force (whether or not this machine supports PDL)."""
    return current().pdl


def _device_capable(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        try:
            import triton.language as tl

            has_gdc = hasattr(tl.extra.cuda, "gdc_wait")
        except (ImportError, AttributeError):
            has_gdc = False
        _capable[index] = has_gdc and torch.cuda.get_device_capability(index)[0] >= 9
    return _capable[index]


def active(device: torch.device) -> bool:
    """Whether kernels launched on `device` now use PDL."""
    if not current().pdl or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _device_capable(device)


def launch_options(device: torch.device) -> dict:
    """The keyword arguments a kernel launch on `device` adds: the kernel's `USE_PDL`
    constexpr and, when it is on, Triton's `launch_pdl` launch option."""
    if active(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
