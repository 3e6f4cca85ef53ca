"""Counting what a CUDA engine's host pays per step, on the CPU (host_step_eagle3.py --ops):
top-level torch calls by name, and the call sites that pin a host staging buffer on CUDA."""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

IGNORED = {"__get__", "__len__", "size", "dim", "numel", "tolist", "item", "__index__",
           "__bool__", "__int__", "__hash__", "__eq__", "__repr__", "__format__",
           "__iter__", "__contains__", "is_floating_point", "stride", "data_ptr",
           "element_size", "is_contiguous", "__reduce_ex__", "__setstate__", "_cdata",
           "shape", "device", "dtype", "is_cuda", "requires_grad", "grad_fn", "ndim"}  # fmt: skip


class CountOps(TorchFunctionMode):
    """Counts top-level torch calls by name (calls made inside a counted call are not)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name == "__get__":  # properties: .shape, .device, .dtype, .T, ...
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def pin_sites() -> list[tuple[object, str]]:
    """Functions that pin a host buffer per call on CUDA, in whichever version runs (this
    one stages through a reused pinned arena instead: `packing.pinned_int64`)."""
    from specserve.runtime import packing, sampled_tokens
    from specserve.spec import eagle3_graphs

    sites = [(packing, "to_device_tensor"), (sampled_tokens, "_to_host")]
    if not hasattr(eagle3_graphs, "staging_int64"):  # before: one pin_memory() per pass
        sites.append((eagle3_graphs.DrafterGraphs, "_load"))
    return [(owner, attr) for owner, attr in sites if hasattr(owner, attr)]


def fake_arena():
    """`packing.pinned_int64` as on CUDA (fresh memory: on the CPU the upload is the host
    buffer itself), so that the calls that pin on CUDA are the ones counted."""
    import numpy as np

    def pinned_int64(n, device):
        array = np.empty(n, np.int64)
        return array, torch.from_numpy(array)

    return pinned_int64
