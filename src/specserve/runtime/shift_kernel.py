"""One kernel for what a packed step's tokens need when the step in flight may have moved
them (runtime/packing.py `pack` with `shift`): each token's position moves right by its
request's accept length in flight, its KV slot is read again from the page table at the new
position (padding: slot 0), and each request's sequence length grows by it. The torch path
runs it as about ten small operations, a launch each; this is one launch (on the H200 a
small model's K=3 step 1.3-1.7% shorter). Same integers
(tests/test_packing_shift.py).

Imported lazily (it defines a kernel: TRITON_INTERPRET is read then).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


# The step's tensors are views into one upload (their alignment changes step to step) and
# its sizes change with the batch: none is specialized on, so no step waits for a compile.
@triton.jit(
    do_not_specialize=[
        "pos_ptr",
        "slot_ptr",
        "owner_ptr",
        "shift_ptr",
        "tables_ptr",
        "lens_ptr",
        "T",
        "B",
        "max_pages",
        "stride_table",
        "page_size",
    ]
)
def _shift_kernel(
    pos_ptr,
    slot_ptr,
    owner_ptr,
    shift_ptr,
    tables_ptr,
    lens_ptr,
    T,
    B,
    max_pages,
    stride_table,
    page_size,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < T
    owner = tl.load(owner_ptr + i, mask=ok, other=0)
    row = tl.where(owner >= 0, owner, -owner - 1)  # padding of segment b: ~b
    pos = tl.load(pos_ptr + i, mask=ok, other=0) + tl.load(shift_ptr + row, mask=ok, other=0)
    page_index = tl.minimum(pos // page_size, max_pages - 1)
    page = tl.load(tables_ptr + row * stride_table + page_index, mask=ok, other=0)
    slot = tl.where(owner >= 0, page * page_size + pos % page_size, 0)
    tl.store(pos_ptr + i, pos, mask=ok)
    tl.store(slot_ptr + i, slot, mask=ok)
    b_ok = i < B
    lens = tl.load(lens_ptr + i, mask=b_ok, other=0)
    tl.store(lens_ptr + i, lens + tl.load(shift_ptr + i, mask=b_ok, other=0), mask=b_ok)


def shift_in_place(
    positions: torch.Tensor,
    slots: torch.Tensor,
    owner: torch.Tensor,
    shift: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
) -> None:
    """positions [T] += shift[row]; slots [T] from `tables` [B, max_pages] at the new
    positions (0 for padding); seq_lens [B] += shift [B], where `owner` [T] holds each
    token's segment row, ~row for its padding. All int64, in place (slots' old values are
    not read)."""
    n, b = positions.shape[0], seq_lens.shape[0]
    if n == 0 and b == 0:
        return
    grid = (triton.cdiv(max(n, b), BLOCK),)
    _shift_kernel[grid](
        positions,
        slots,
        owner,
        shift,
        tables,
        seq_lens,
        n,
        b,
        tables.shape[1],
        tables.stride(0),
        page_size,
        BLOCK=BLOCK,
    )


def warm_up(device: torch.device) -> None:
    """Compile the kernel now (engine start-up), not at the first shifted step: its one
    variant serves every step (it specializes on no input)."""
    i64 = dict(dtype=torch.int64, device=device)
    one = [torch.zeros(1, **i64) for _ in range(5)]
    shift_in_place(one[0], one[1], one[2], one[3], torch.zeros(1, 1, **i64), one[4], 16)
