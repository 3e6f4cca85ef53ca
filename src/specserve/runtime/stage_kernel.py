"""One kernel that copies a step into the target graphs' static input buffers, what
runtime/graph_staging.py `stage_torch` does in up to ten launches (the same integers:
tests/test_graph_staging.py).

It is launched without PDL, as a torch copy is: the attention kernels of the graph read
what it writes before their PDL wait (kernels/pdl.py), which holds only for work that has
completed before the graph's first kernel starts.

Imported lazily (it defines a kernel: TRITON_INTERPRET is read then).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 512


# The step's tensors are views into one upload (their alignment changes step to step) and
# its sizes change with the batch: none is specialized on, so no step waits for a compile.
@triton.jit(
    do_not_specialize=[
        "ids_src",
        "pos_src",
        "slot_src",
        "lens_src",
        "tables_src",
        "ids_dst",
        "pos_dst",
        "slot_dst",
        "lens_dst",
        "tables_dst",
        "n",
        "padded_n",
        "requests",
        "batch",
        "width",
        "stride_src",
        "stride_dst",
    ]
)
def _stage_kernel(
    ids_src,
    pos_src,
    slot_src,
    lens_src,
    tables_src,
    ids_dst,
    pos_dst,
    slot_dst,
    lens_dst,
    tables_dst,
    n,
    padded_n,
    requests,
    batch,
    width,
    stride_src,
    stride_dst,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    real = i < n  # tokens: the step's, then padding (zeros) up to the bucket's
    token = i < padded_n
    tl.store(ids_dst + i, tl.load(ids_src + i, mask=real, other=0), mask=token)
    tl.store(pos_dst + i, tl.load(pos_src + i, mask=real, other=0), mask=token)
    tl.store(slot_dst + i, tl.load(slot_src + i, mask=real, other=0), mask=token)
    lens = tl.load(lens_src + i, mask=i < requests, other=1)  # padded requests: length 1
    tl.store(lens_dst + i, lens, mask=i < batch)
    row, col = i // width, i % width  # the step's page tables, row by row
    cell = i < requests * width
    page = tl.load(tables_src + row * stride_src + col, mask=cell, other=0)
    tl.store(tables_dst + row * stride_dst + col, page, mask=cell)
    pad_row = requests + i  # padded requests: their first page is the scratch page 0
    tl.store(tables_dst + pad_row * stride_dst, tl.zeros_like(pad_row), mask=pad_row < batch)


def stage(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    tables: torch.Tensor,
    dst: tuple[torch.Tensor, ...],
    batch: int,
    tokens: int,
) -> None:
    """Copy a step of `seq_lens.shape[0]` requests into `dst` = (input_ids, positions,
    slot_mapping, seq_lens, block_tables) static buffers, padded to `batch` requests and
    `tokens` tokens. All int64 (`graph_staging.stageable`); `tables` [R, W], any row stride,
    0 < W <= the static tables' width."""
    ids_dst, pos_dst, slot_dst, lens_dst, tables_dst = dst
    requests, width = seq_lens.shape[0], tables.shape[1]
    n, padded_n = input_ids.shape[0], tokens
    size = max(padded_n, batch, requests * width, 1)
    grid = (triton.cdiv(size, BLOCK),)
    _stage_kernel[grid](
        input_ids,
        positions,
        slots,
        seq_lens,
        tables,
        ids_dst,
        pos_dst,
        slot_dst,
        lens_dst,
        tables_dst,
        n,
        padded_n,
        requests,
        batch,
        width,
        tables.stride(0),
        tables_dst.stride(0),
        BLOCK=BLOCK,
    )


def warm_up(device: torch.device) -> None:
    """Compile the kernel now (engine start-up), not at the first step: its one variant
    serves every step (it specializes on no input)."""
    i64 = dict(dtype=torch.int64, device=device)
    src = [torch.zeros(1, **i64) for _ in range(4)]
    dst = (*(torch.zeros(2, **i64) for _ in range(4)), torch.zeros(2, 2, **i64))
    stage(*src, torch.zeros(1, 1, **i64), dst, batch=2, tokens=2)
