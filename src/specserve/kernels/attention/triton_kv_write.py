"""The Triton KV write: each token's K/V row (all KV heads) stored at its slot in the paged
cache, slots < 0 skipped, and the cache layout every attention kernel indexes
(`check_cache`). Used by the Triton attention backend when the model's fused rotary + KV
write did not store the rows already; may be launched with programmatic dependent launch
(kernels/pdl.py).

Imported by triton_kernels.py, and like it only when kernels may be defined (TRITON_INTERPRET
is read then).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl
from specserve.kernels.pdl_kernel import pdl_enter


@triton.jit(do_not_specialize=["slot_ptr"])  # a view into the step's upload
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache,
    v_cache,
    slot_ptr,
    stride_kt,
    stride_vt,
    stride_page,
    stride_slot,
    PAGE_SIZE: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # kernels/pdl.py
        pdl_enter()
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    cols = tl.arange(0, BLOCK)
    ok = cols < tl.where(slot >= 0, ROW, 0)  # a negative slot means: do not store
    dst = (slot // PAGE_SIZE) * stride_page + (slot % PAGE_SIZE) * stride_slot + cols
    k = tl.load(k_ptr + t * stride_kt + cols, mask=ok)
    v = tl.load(v_ptr + t * stride_vt + cols, mask=ok)
    tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=ok)
    tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=ok)


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Store each token's K/V row (all KV heads) at its slot; slots < 0 are skipped.
    k = v = None: nothing to store (the model's fused rotary + KV write stored them)."""
    if k is None and v is None:
        return
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 and k.stride(-2) == k.shape[-1] else k.contiguous()
    v = v if v.stride(-1) == 1 and v.stride(-2) == v.shape[-1] else v.contiguous()
    _check_cache(k_cache, v_cache)
    row = k_cache.shape[2] * k_cache.shape[3]
    _kv_write_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        PAGE_SIZE=k_cache.shape[1],
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
        **pdl.launch_options(k.device),
    )


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise unless the caches have the layout the kernels index: contiguous (kv_heads,
    head_dim) rows and equal strides."""
    kvh, hd = k_cache.shape[2:]
    if k_cache.stride()[2:] != (hd, 1) or k_cache.stride() != v_cache.stride():
        raise ValueError(
            "K/V caches must be [pages, page_size, kv_heads, head_dim] with "
            "contiguous (kv_heads, head_dim) rows and equal strides"
        )


_check_cache = check_cache
