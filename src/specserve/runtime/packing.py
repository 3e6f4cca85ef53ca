"""Pack token segments of several requests into one forward's tensors (ids + metadata)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from specserve.layers.attention import AttentionMetadata


@dataclass
class Segment:
    """`token_ids` written at positions start.. of a request whose pages are `page_table`;
    attention covers positions < start + len(token_ids).

    `pad` extra tokens follow (to give every request of a step the same length, as a CUDA
    graph needs): they repeat the last real token's position, so a kernel sees the same
    visible keys, write their K/V to the scratch page 0, and their outputs are ignored.

    `max_shift`: the segment may move right by up to this many positions on the device
    (`pack`'s `shift`: the step in flight's accepted drafts, unknown to the host); its
    pages cover the shifted positions.
    """

    page_table: list[int]
    start: int
    token_ids: list[int]
    pad: int = 0
    max_shift: int = 0


class PinnedArena:
    """Pinned host memory for host-to-device copies, reused instead of pinned per copy
    (pinning a fresh buffer costs the host ~10 us a call on CUDA; a step makes several).

    Two halves, taken in turn: `take(n)` hands out the next n slots of the current half;
    when it is full the other half becomes current, after waiting for the event recorded
    when that half was left (all copies queued from it had finished: in practice long ago,
    a half holds hundreds of steps' uploads). Copies from a taken buffer must be queued
    before the next `take` that could wrap: callers copy right away."""

    def __init__(self, half_slots: int = 1 << 20):
        self.half_slots = half_slots
        self.halves = [
            torch.empty(half_slots, dtype=torch.int64, pin_memory=True) for _ in range(2)
        ]
        self.arrays = [h.numpy() for h in self.halves]
        self.events: list = [None, None]
        self.current, self.used = 0, 0

    def take(self, n: int) -> tuple[np.ndarray, torch.Tensor] | None:
        """(numpy view, tensor view) of n pinned int64 slots; None when n is too large."""
        if n > self.half_slots // 4:
            return None
        if self.used + n > self.half_slots:
            event = torch.cuda.Event()
            event.record()
            self.events[self.current] = event
            self.current ^= 1
            if self.events[self.current] is not None:
                self.events[self.current].synchronize()
            self.used = 0
        start, self.used = self.used, self.used + n
        i = self.current
        return self.arrays[i][start : start + n], self.halves[i][start : start + n]


_arenas: dict[torch.device, PinnedArena] = {}  # one per device, made on first use


def pinned_int64(n: int, device: torch.device) -> tuple[np.ndarray, torch.Tensor] | None:
    """Pinned staging for n int64 values bound for `device` (CUDA only; None elsewhere or
    when too large): fill the numpy view, copy the tensor view to the device right away."""
    if device.type != "cuda":
        return None
    arena = _arenas.get(device)
    if arena is None:
        arena = _arenas[device] = PinnedArena()
    return arena.take(n)


def staging_int64(n: int, device: torch.device) -> tuple[np.ndarray, torch.Tensor]:
    """n int64 host slots to fill (numpy view) and copy to `device` (tensor view) right
    away: pinned arena memory on CUDA, a fresh array elsewhere."""
    staged = pinned_int64(n, device)
    if staged is None:
        array = np.empty(n, np.int64)
        return array, torch.from_numpy(array)
    return staged


def to_device(values: list, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    if dtype == torch.int64:
        return upload_array(np.array(values, np.int64), device)
    return to_device_tensor(torch.tensor(values, dtype=dtype), device)


def to_device_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` through pinned memory: the copy never waits for the
    device (from pageable memory it may), so the host can run ahead of the device."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def upload_array(flat: np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 numpy array on `device`: through the pinned arena on CUDA (one copy), as is
    (a tensor sharing its memory) elsewhere."""
    staged = pinned_int64(len(flat), device)
    if staged is None:
        return to_device_tensor(torch.from_numpy(flat), device)
    host_view, host = staged
    host_view[:] = flat
    return host.to(device, non_blocking=True)


def upload(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Integer lists on the device through one (pinned) copy; a view per list, in order."""
    sizes = [len(values) for values in lists]
    flat = np.array(list(chain.from_iterable(lists)), np.int64)  # numpy: ~5x torch.tensor
    return list(upload_array(flat, device).split(sizes))


# From this many tokens a step's positions and KV slots are computed with numpy rather than
# token by token (measured on one CPU core: numpy costs ~60 us however small the step, the
# loop ~0.15 us a token and ~0.5 us a segment; a 2048-token prefill packs in 117 us
# instead of 324, a 256-token verify step of 64 requests costs the same either way).
VECTOR_MIN_TOKENS = 512
# On CUDA a shifted step's positions, slots and lengths are moved in one kernel
# (runtime/shift_kernel.py) instead of about ten torch operations (False: the torch path)
SHIFT_KERNEL = True


def use_shift_kernel(device: torch.device) -> bool:
    return SHIFT_KERNEL and device.type == "cuda"


def positions_and_slots(
    segments: list[Segment],
    tables: list[int],
    max_pages: int,
    page_size: int,
    pads: list[int] | None = None,
):
    """Each token's position, KV slot and segment (~segment, below 0: padding of that
    segment), as numpy arrays: what pack's loop computes, vectorized for large steps.
    `tables`: the segments' page tables, each padded to max_pages; `pads`: padding per
    segment (default: each one's `pad`)."""
    n = len(segments)
    lens = np.fromiter((len(s.token_ids) for s in segments), np.int64, n)
    if pads is None:
        pads = [s.pad for s in segments]
    widths = lens + np.asarray(pads, np.int64)
    starts = np.fromiter((s.start for s in segments), np.int64, n)
    seg = np.repeat(np.arange(n), widths)
    j = np.arange(len(seg)) - np.repeat(np.cumsum(widths) - widths, widths)
    seg_lens = lens[seg]
    real = j < seg_lens
    positions = starts[seg] + np.minimum(j, seg_lens - 1)  # padding: the last position
    page = np.asarray(tables, np.int64).reshape(n, max_pages)[seg, positions // page_size]
    slots = np.where(real, page * page_size + positions % page_size, 0)
    return positions, slots, np.where(real, seg, ~seg)


def pack(
    segments: list[Segment],
    page_size: int,
    device: torch.device,
    shift: torch.Tensor | None = None,
):
    """Return (input_ids [T], AttentionMetadata, last_row [B]: each segment's last real
    row). Every integer goes to the device in one copy.

    `shift` [B] (on the device) moves segment b right by shift[b] positions after the
    upload, without the host knowing it: positions and seq_lens grow by it, real tokens'
    slots are recomputed from the page table; max_seq_len counts each segment's
    `max_shift`."""
    max_pages = max(len(s.page_table) for s in segments)
    input_ids: list[int] = []
    tables: list[int] = []
    starts, seq_lens, bounds = [0], [], []
    for s in segments:
        input_ids += s.token_ids
        if s.pad:
            input_ids += [s.token_ids[-1]] * s.pad
        table = s.page_table
        tables += table + [0] * (max_pages - len(table))
        end = s.start + len(s.token_ids)
        starts.append(starts[-1] + len(s.token_ids) + s.pad)
        seq_lens.append(end)
        bounds.append(end + s.max_shift)
    if len(input_ids) >= VECTOR_MIN_TOKENS:
        positions, slots, owner = positions_and_slots(segments, tables, max_pages, page_size)
        if shift is None:
            owner = owner[:0]
        parts = [input_ids, positions, slots, starts, seq_lens, tables, owner]
        flat = np.concatenate([np.asarray(part, np.int64) for part in parts])
        sizes = [len(part) for part in parts]
        ids_t, pos_t, slots_t, starts_t, lens_t, tables_t, owner_t = upload_array(
            flat, device
        ).split(sizes)
    else:
        positions, slots, owner = [], [], []  # owner, with a shift: each token's segment
        for b, s in enumerate(segments):
            end, table = s.start + len(s.token_ids), s.page_table
            for pos in range(s.start, end):
                positions.append(pos)
                slots.append(table[pos // page_size] * page_size + pos % page_size)
            if s.pad:
                positions += [end - 1] * s.pad
                slots += [0] * s.pad
            if shift is not None:
                owner += [b] * len(s.token_ids) + [~b] * s.pad  # ~b: b's padding
        ids_t, pos_t, slots_t, starts_t, lens_t, tables_t, owner_t = upload(
            [input_ids, positions, slots, starts, seq_lens, tables, owner], device
        )
    tables_t = tables_t.view(len(segments), max_pages)
    query_lens = [len(s.token_ids) + s.pad for s in segments]
    if shift is not None and use_shift_kernel(device):
        from specserve.runtime.shift_kernel import shift_in_place

        shift_in_place(pos_t, slots_t, owner_t, shift, tables_t, lens_t, page_size)
    elif shift is not None:
        padded = any(s.pad for s in segments)
        rows = torch.where(owner_t >= 0, owner_t, ~owner_t) if padded else owner_t
        pos_t += shift[rows]  # padding repeats its segment's last position: shifted too
        page = tables_t[rows, (pos_t // page_size).clamp(max=max_pages - 1)]
        slots_t = page * page_size + pos_t % page_size
        if padded:
            slots_t = torch.where(owner_t >= 0, slots_t, 0)
        lens_t += shift
    meta = AttentionMetadata(
        positions=pos_t,
        slot_mapping=slots_t,
        query_start_loc=starts_t,
        seq_lens=lens_t,
        block_tables=tables_t,
        max_query_len=max(query_lens),
        max_seq_len=max(bounds),
        query_lens=query_lens,
        seq_bounds=bounds,
    )
    last_rows = [e - 1 - s.pad for e, s in zip(starts[1:], segments)]
    return ids_t, meta, last_rows
