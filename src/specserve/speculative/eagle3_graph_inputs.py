"""Inputs of one EAGLE-3 head pass into DrafterGraphs' static buffers (eagle3_graphs.py).

The integers (seq_lens, last rows, token ids, positions, KV slots, a catch-up tail's rows)
go up as one host image in one copy (pinned arena memory on CUDA), the page tables in a
second (a catch-up pass that only writes the head's KV, `load_catch_up`, needs none);
positions and slots of large passes are computed with numpy. The head's inputs are
copied or gathered from the feature store by KV slot, on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.runtime.inflight import CatchUpTail
from specserve.runtime.packing import VECTOR_MIN_TOKENS, positions_and_slots, staging_int64

if TYPE_CHECKING:
    from specserve.speculative.eagle3_graphs import DrafterGraphs


def load_pass(g: DrafterGraphs, segments, hidden, input_ids, tail=None) -> tuple[int, int, int]:
    """Copy a pass into `g`'s static buffers, padded to (bucket, captured length): the
    integer inputs go up in one host image (pinned on CUDA) and one copy, the page
    tables in a second; padded requests are filled on the host too. A `tail`'s tokens
    and drafting rows are then set on the device, and the head's inputs copied (or
    gathered from the feature store by the pass's KV slots)."""
    num_requests = len(segments)
    lens = [len(s.token_ids) for s in segments]
    q = g.length_for(max(lens))
    batch, ps = g.bucket_for(num_requests), g.page_size
    width = max(len(s.page_table) for s in segments)
    ids, pos, slots, seq_lens, last_rows, tables = [], [], [], [], [], []
    vectorized = num_requests * q >= VECTOR_MIN_TOKENS
    for b, (s, n) in enumerate(zip(segments, lens)):
        end, pad, table = s.start + n, q - n, s.page_table
        # Padded tokens repeat the last token and position and write to page 0.
        ids += s.token_ids + [s.token_ids[-1]] * pad
        if not vectorized:
            pos += range(s.start, end)
            slots += [table[p // ps] * ps + p % ps for p in range(s.start, end)]
            slots += [0] * pad
            pos += [end - 1] * pad
        seq_lens.append(end)
        last_rows.append(b * q + n - 1)
        tables += table + [0] * (width - len(table))
    if vectorized:
        pos, slots, _ = positions_and_slots(segments, tables, width, ps, [q - n for n in lens])
    n_pad = batch - num_requests  # padded requests: position 0 on page 0
    n = batch * q
    seq_lens += [1] * n_pad
    last_rows += range(num_requests * q, batch * q, q)
    tables += [0] * (n_pad * width)
    dest, src = (), ()
    # Dense tail: each request's pass is exactly its row of the tail's tokens (the
    # catch-up right after a verify step), copied as one block.
    dense = tail is not None and _is_dense(tail, lens, q)
    if dense:  # each drafts from its row's start plus its accept length
        last_rows[:num_requests] = range(0, num_requests * q, q)
    elif tail is not None:
        dest, src, last = tail.index(range(0, num_requests * q, q), lens)
        last_rows[:num_requests] = last
    o_seq, o_last, o_ids, o_pos, o_slots, o_dest, o_src = g._offsets
    span = o_src + len(src)
    image, host = staging_int64(span, g.ints.device)
    image[o_seq : o_seq + batch] = seq_lens
    image[o_last : o_last + batch] = last_rows
    m = num_requests * q
    image[o_ids : o_ids + m] = ids
    image[o_pos : o_pos + m] = pos
    image[o_slots : o_slots + m] = slots
    if n_pad:
        image[o_ids + m : o_ids + n] = 0
        image[o_pos + m : o_pos + n] = 0
        image[o_slots + m : o_slots + n] = 0
    image[o_dest : o_dest + len(dest)] = dest
    image[o_src:span] = src
    g.ints[:span].copy_(host, non_blocking=True)
    t_image, t_host = staging_int64(batch * width, g.ints.device)
    t_image[:] = tables
    g.block_tables[:batch, :width].copy_(t_host.view(batch, width), non_blocking=True)
    if n_pad:  # whole rows: chains index past column 0
        g.block_tables[num_requests:batch, width:] = 0
    if dense:
        g.input_ids[: num_requests * q].view(num_requests, q).copy_(tail.tokens)
        g.last_rows[:num_requests].add_(tail.accepted)  # rows from the row's start
    elif tail is not None:
        k = len(dest)
        g.input_ids[g.tail_dest[:k]] = tail.tokens.reshape(-1)[g.tail_src[:k]]
        g.last_rows[:num_requests].add_(tail.accepted)
    if input_ids is not None:
        if q != 1:
            raise ValueError("device input ids are only taken for one-token passes")
        g.input_ids[:num_requests].copy_(input_ids)
    if hidden is None:  # every row's feature by its slot (padding rows: scratch slot 0)
        torch.index_select(g.feature_store, 0, g.slot_mapping[:n], out=g.hidden[:n])
    elif all(k == q for k in lens):
        g.hidden[: num_requests * q].copy_(hidden)
    else:
        dest_rows = [b * q + i for b, k in enumerate(lens) for i in range(k)]
        rows_t = torch.from_numpy(np.array(dest_rows, np.int64)).to(g.hidden.device)
        g.hidden.index_copy_(0, rows_t, hidden)
    return num_requests, batch, q


def _is_dense(tail: CatchUpTail, lens: list[int], q: int) -> bool:
    """Whether request b's pass is row b of the tail's tokens, whole: tail lengths, pass
    lengths and the tokens' width all q, rows in order."""
    n = len(lens)
    return (
        tail.tokens.shape[0] == n
        and tail.tokens.shape[1] == q
        and tail.rows[-1] == n - 1
        and tail.lens == lens
        and lens[0] == q
        and tail.rows == list(range(n))
        and all(k == q for k in lens)
    )


def load_catch_up(g: DrafterGraphs, segments, tail: CatchUpTail | None = None) -> int:
    """Copy a catch-up pass (segments' token ids, positions and KV slots, packed in order)
    into `g`'s static buffers padded to its token bucket, in one host image and one copy
    (padded tokens: id 0 at position 0, scratch slot 0); a `tail`'s tokens then take their
    rows on the device. Returns the bucket."""
    lens = [len(s.token_ids) for s in segments]
    n = sum(lens)
    tokens = g.catch_up_bucket(n)
    width = max(len(s.page_table) for s in segments)
    ids, tables = [], []
    for s in segments:
        ids += s.token_ids
        tables += s.page_table + [0] * (width - len(s.page_table))
    pos, slots, _ = positions_and_slots(segments, tables, width, g.page_size, [0] * len(lens))
    dest, src = (), ()
    if tail is not None:
        starts = np.cumsum([0] + lens[:-1]).tolist()
        dest, src, _ = tail.index(starts, lens)
    _, _, o_ids, o_pos, o_slots, o_dest, o_src = g._offsets
    # (ids, positions, slots; a tail's destination and source rows after them)
    span = o_src + len(src) - o_ids if tail is not None else o_slots + tokens - o_ids
    image, host = staging_int64(span, g.ints.device)
    for offset, values in ((o_ids, ids), (o_pos, pos), (o_slots, slots)):
        at = offset - o_ids
        image[at : at + n] = values
        image[at + n : at + tokens] = 0
    image[o_dest - o_ids : o_dest - o_ids + len(dest)] = dest
    image[o_src - o_ids : span] = src
    g.ints[o_ids : o_ids + span].copy_(host, non_blocking=True)
    if tail is not None:
        k = len(dest)
        g.input_ids[g.tail_dest[:k]] = tail.tokens.reshape(-1)[g.tail_src[:k]]
    return tokens
