"""Pack token segments of several requests into one forward's tensors (ids + metadata)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.layers.attention import AttentionMetadata


@dataclass
class Segment:
    """`token_ids` written at positions start.. of a request whose pages are `page_table`;
    attention covers positions < start + len(token_ids)."""

    page_table: list[int]
    start: int
    token_ids: list[int]


def to_device(values: list, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def pack(segments: list[Segment], page_size: int, device: torch.device):
    """Return (input_ids [T], AttentionMetadata, last_row [B]: each segment's last row)."""
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
        starts.append(starts[-1] + len(s.token_ids))
        seq_lens.append(end)
        tables += table + [0] * (max_pages - len(table))
    meta = AttentionMetadata(
        positions=to_device(positions, device),
        slot_mapping=to_device(slots, device),
        query_start_loc=to_device(starts, device),
        seq_lens=to_device(seq_lens, device),
        block_tables=to_device(tables, device).view(len(segments), max_pages),
        max_query_len=max(len(s.token_ids) for s in segments),
        max_seq_len=max(seq_lens),
    )
    return to_device(input_ids, device), meta, [e - 1 for e in starts[1:]]
