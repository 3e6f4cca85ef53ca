"""A step's copy into the target graphs' static input buffers (`CudaGraphRunner.run`): token
ids, positions and KV slots of the real tokens and zeros for the padding up to the graph's
token count; sequence lengths, 1 for padded requests; the page tables' rows, and column 0 of a
padded request's row set to the scratch page 0 (runtime/cuda_graphs.py says why padding is
harmless). On CUDA one kernel does it (runtime/stage_kernel.py), elsewhere, or for tensors
the kernel does not take, torch: five copies and, off bucket sizes, five fills, a launch
each on a GPU. Both write the same integers (tests/test_graph_staging.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from specserve.core.kernel_options import current
from specserve.layers.attention import AttentionMetadata


class StaticInputs(Protocol):
    """The buffers a step is copied into (`CudaGraphRunner`'s)."""

    input_ids: torch.Tensor  # [max tokens]
    positions: torch.Tensor  # [max tokens]
    slot_mapping: torch.Tensor  # [max tokens]
    seq_lens: torch.Tensor  # [max requests]
    block_tables: torch.Tensor  # [max requests, max pages]


def use_stage_kernel(device: torch.device) -> bool:
    """Whether steps on `device` are staged by the kernel."""
    return current().stage_kernel and device.type == "cuda"  # (off: torch's copies)


def stageable(input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether the kernel can take this step: int64 token ids, positions, slots and lengths
    each in one piece, and a page table of at least one column whose rows are each in one
    piece (as `packing.pack` uploads them)."""
    flat = (input_ids, meta.positions, meta.slot_mapping, meta.seq_lens)
    tables = meta.block_tables
    return (
        all(t.dtype == torch.int64 and t.dim() == 1 and t.is_contiguous() for t in flat)
        and tables.dtype == torch.int64
        and tables.shape[1] > 0
        and tables.stride(1) == 1
    )


def stage_step(
    bufs: StaticInputs, input_ids: torch.Tensor, meta: AttentionMetadata, batch: int, tokens: int
) -> None:
    """Copy a step of `meta.num_requests` requests into `bufs`, padded to `batch` requests
    and `tokens` tokens: by the kernel where it applies, else through torch."""
    if use_stage_kernel(input_ids.device) and stageable(input_ids, meta):
        from specserve.runtime.stage_kernel import stage  # (defines a kernel: lazily)

        stage(
            input_ids,
            meta.positions,
            meta.slot_mapping,
            meta.seq_lens,
            meta.block_tables,
            (bufs.input_ids, bufs.positions, bufs.slot_mapping, bufs.seq_lens, bufs.block_tables),
            batch,
            tokens,
        )
    else:
        stage_torch(bufs, input_ids, meta, batch, tokens)


def stage_torch(
    bufs: StaticInputs, input_ids: torch.Tensor, meta: AttentionMetadata, batch: int, tokens: int
) -> None:
    """`stage_step` through torch (a launch per copy and per fill on a GPU)."""
    num_requests = meta.num_requests
    n = input_ids.shape[0]
    bufs.input_ids[:n].copy_(input_ids, non_blocking=True)
    bufs.positions[:n].copy_(meta.positions, non_blocking=True)
    bufs.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
    bufs.seq_lens[:num_requests].copy_(meta.seq_lens, non_blocking=True)
    width = meta.block_tables.shape[1]
    bufs.block_tables[:num_requests, :width].copy_(meta.block_tables, non_blocking=True)
    if tokens > n:
        padded = slice(n, tokens)
        bufs.input_ids[padded] = 0
        bufs.positions[padded] = 0
        bufs.slot_mapping[padded] = 0
    if batch > num_requests:
        bufs.seq_lens[num_requests:batch] = 1
        bufs.block_tables[num_requests:batch, 0] = 0
