"""Pack token segments of several requests into one forward's tensors (ids + metadata)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.layers.attention import AttentionMetadata


@dataclass
class Segment:
    """`token_ids` written at positions start.. of a request whose pages are `page_table`;
    attention covers positions < start + len(token_ids).

    `pad` extra tokens follow (to give every request of a step the same length, as a CUDA
    graph needs): they repeat the last real token's position, so a kernel sees the same
    visible keys, write their K/V to the scratch page 0, and their outputs are ignored.
    """

    page_table: list[int]
    start: int
    token_ids: list[int]
    pad: int = 0


def to_device(values: list, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    return to_device_tensor(torch.tensor(values, dtype=dtype), device)


def to_device_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` through pinned memory: the copy never waits for the
    device (from pageable memory it may), so the host can run ahead of the device."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def pack(segments: list[Segment], page_size: int, device: torch.device):
    """Return (input_ids [T], AttentionMetadata, last_row [B]: each segment's last real
    row)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    seq_lens: list[int] = []
    max_pages = max(len(s.page_table) for s in segments)
    tables: list[int] = []
    for s in segments:
        end = s.start + len(s.token_ids)
        input_ids += s.token_ids
        table = s.page_table
        for pos in range(s.start, end):
            positions.append(pos)
            slots.append(table[pos // page_size] * page_size + pos % page_size)
        if s.pad:
            input_ids += [s.token_ids[-1]] * s.pad
            positions += [end - 1] * s.pad
            slots += [0] * s.pad
        starts.append(starts[-1] + len(s.token_ids) + s.pad)
        seq_lens.append(end)
        tables += table + [0] * (max_pages - len(table))
    meta = AttentionMetadata(
        positions=to_device(positions, device),
        slot_mapping=to_device(slots, device),
        query_start_loc=to_device(starts, device),
        seq_lens=to_device(seq_lens, device),
        block_tables=to_device(tables, device).view(len(segments), max_pages),
        max_query_len=max(len(s.token_ids) + s.pad for s in segments),
        max_seq_len=max(seq_lens),
    )
    last_rows = [e - 1 - s.pad for e, s in zip(starts[1:], segments)]
    return to_device(input_ids, device), meta, last_rows
