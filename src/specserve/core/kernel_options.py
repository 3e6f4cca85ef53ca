"""Switches of the GPU kernels that each engine sets for its own work, not the process's.

An engine's `KernelOptions` come from its EngineConfig and hold while its start-up and its
steps run (`using`, around them): two engines of one process (an A/B benchmark, the tests)
each launch their kernels as configured. Outside every engine's block the process default
holds (`current`; tools and kernel tests change it with `set_default`). CUDA graphs keep
what was in force when they were captured.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace

ARGMAX_MODES = ("off", "graphs", "always")


@dataclass(frozen=True)
class KernelOptions:
    """pdl: programmatic dependent launch where the GPU and Triton support it
    (kernels/pdl.py); argmax: when the row argmax takes the Triton kernels, one of
    ARGMAX_MODES (kernels/triton_argmax.py); stream_k: the stream-K GEMV tiles among the
    start-up selection's candidates (kernels/gemv_configs.py); stage_kernel: a graph step's
    inputs staged by one kernel rather than torch copies (runtime/graph_staging.py)."""

    pdl: bool = True
    argmax: str = "graphs"
    stream_k: bool = False
    stage_kernel: bool = True

    def __post_init__(self) -> None:
        if self.argmax not in ARGMAX_MODES:
            raise ValueError(f"argmax mode must be one of {ARGMAX_MODES}, got {self.argmax!r}")


_default = KernelOptions()
_active: ContextVar[KernelOptions | None] = ContextVar("specserve_kernel_options", default=None)


def current() -> KernelOptions:
    """The options in force: the running engine's, else the process default."""
    return _active.get() or _default


def set_default(**changes) -> KernelOptions:
    """Change the process default (fields of KernelOptions); returns the previous one."""
    global _default
    previous, _default = _default, replace(_default, **changes)
    return previous


@contextmanager
def using(options: KernelOptions) -> Iterator[None]:
    """`options` in force for the block (this thread and its context)."""
    token = _active.set(options)
    try:
        yield
    finally:
        _active.reset(token)
