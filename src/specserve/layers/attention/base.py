"""The attention backend interface and the per-step metadata every backend reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit, built once per step by the model runner.

    Tokens of all requests are packed along one axis (T tokens, B requests). Request b owns
    tokens query_start_loc[b]:query_start_loc[b+1]; after this step its KV covers
    seq_lens[b] positions, the new tokens being the last ones up to their own positions
    (positions need not end at seq_lens - 1 when speculative tokens are laid past it).
    """

    positions: torch.Tensor  # [T] int64, absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64, page * page_size + offset where its K/V go
    query_start_loc: torch.Tensor  # [B+1] int64
    seq_lens: torch.Tensor  # [B] int64, KV length each request attends over
    block_tables: torch.Tensor  # [B, max_pages] int64, page ids (padding is page 0)
    max_query_len: int
    max_seq_len: int
    # Host copies the model runner's packing keeps (None where metadata is built by hand):
    # each request's query length (padding included) and the longest KV length it may reach.
    # A backend can then serve a step's short rows and its prefill chunks apart (mixed steps).
    query_lens: list[int] | None = None
    seq_bounds: list[int] | None = None
    # A mixed step in a CUDA graph (runtime/cuda_graphs.py): its two launches' shares, fixed
    # in shape; None elsewhere.
    mixed: MixedLayout | None = None
    # Whether a prefill chunk is among the step's rows (not decode and verify rows alone):
    # its dense layers then look their kernels up by row count, not by request count
    # (kernels/gemv_plan.py: batch invariance covers decode and verify steps only).
    prefill: bool = False
    # split(): its answer per threshold, computed once a step (every layer asks)
    _splits: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    def split(self, most: int) -> tuple[int, AttentionMetadata, AttentionMetadata] | None:
        """(tokens, head, tail) for a step whose leading requests have at most `most`
        query tokens each and the rest more: the first `tokens` tokens are theirs. None
        when there is nothing to split: every request or none is short, or the host query
        lengths are unknown (metadata built for a CUDA graph or by hand)."""
        if most in self._splits:
            return self._splits[most]
        out = None
        if self.query_lens is not None:
            if len(self.query_lens) != self.num_requests:
                raise ValueError("query_lens does not match the step's requests")
            n = next((i for i, q in enumerate(self.query_lens) if q > most), len(self.query_lens))
            if 0 < n < self.num_requests:
                out = (sum(self.query_lens[:n]), self.head(n), self.tail(n))
        self._splits[most] = out
        return out

    def head(self, n: int) -> AttentionMetadata:
        """The metadata of the first n requests, whose tokens lead the step's."""
        query_lens, seq_bounds = self._host()
        return AttentionMetadata(
            self.positions,
            self.slot_mapping,
            self.query_start_loc[: n + 1],
            self.seq_lens[:n],
            self.block_tables[:n],
            max(query_lens[:n]),
            max(seq_bounds[:n]),
            query_lens[:n],
            seq_bounds[:n],
        )

    def tail(self, n: int) -> AttentionMetadata:
        """The metadata of the requests from n on, for their tokens alone: token offsets
        start at 0 at the first of them (sum(query_lens[:n]) into the step)."""
        query_lens, seq_bounds = self._host()
        first = sum(query_lens[:n])
        return AttentionMetadata(
            self.positions[first:],
            self.slot_mapping[first:],
            self.query_start_loc[n:] - first,
            self.seq_lens[n:],
            self.block_tables[n:],
            max(query_lens[n:]),
            max(seq_bounds[n:]),
            query_lens[n:],
            seq_bounds[n:],
        )

    def _host(self) -> tuple[list[int], list[int]]:
        if self.query_lens is None or self.seq_bounds is None:
            raise ValueError("splitting a step's metadata needs its host query lengths")
        return self.query_lens, self.seq_bounds


# Rows (token x query head of one KV head) per program of a mixed graph's prefill launch.
TILE_ROWS = 128


@dataclass
class MixedLayout:
    """A mixed step (decode and verify rows, then prefill chunks) laid out for one CUDA graph
    whatever its composition: launch shapes fixed by the graph's (requests, tokens) bucket,
    the split between the two kinds of rows given on the device.

    The leading requests of at most `short_query_len` tokens are "short": `short_query_start`
    [B+1] bounds their tokens as query_start_loc does and gives every later request none, so
    a decode-path launch over the first `short_tokens` tokens serves them alone. The others'
    rows are cut into blocks of TILE_ROWS rows, listed in `tiles` [N, 2] as (request, block),
    (-1, 0) past the step's: a prefill-path launch of N programs per KV head serves them.
    Rows of neither (the graph's padding) come out 0.
    """

    short_query_start: torch.Tensor  # [B + 1] int64
    short_query_len: int
    short_tokens: int
    tiles: torch.Tensor  # [N, 2] int64


def mixed_tiles(query_lens: list[int], first: int, group: int, count: int) -> list[int]:
    """`MixedLayout.tiles` flattened: (request, block) for the TILE_ROWS-row blocks of
    requests `first`.. (query_lens: each request's tokens; group: query heads per KV head),
    then (-1, 0) up to `count` tiles. Raises if they do not fit."""
    tiles = []
    for b in range(first, len(query_lens)):
        for block in range(-(-query_lens[b] * group // TILE_ROWS)):
            tiles += (b, block)
    if len(tiles) > 2 * count:
        raise ValueError(f"{len(tiles) // 2} row blocks do not fit {count} tiles")
    return tiles + [-1, 0] * (count - len(tiles) // 2)


def max_mixed_tiles(num_tokens: int, num_requests: int, group: int) -> int:
    """The most tiles a step of up to `num_tokens` tokens over `num_requests` requests can
    need: its rows in whole blocks, plus one partial block per request."""
    return -(-num_tokens * group // TILE_ROWS) + num_requests


class AttentionBackend(ABC):
    """Writes the new tokens' K/V into the paged cache, then attends causally.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim];
    k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim].
    A token at position p sees cached positions 0..p of its own request.
    """

    name: str = "abstract"
    # Keep a decode or verify row's bits whatever the step's request count, where the
    # backend's arithmetic could depend on it (the Triton backend's KV splits); the engine
    # sets it from --disable-batch-invariance.
    batch_invariant: bool = True
    # Serves a mixed step inside a CUDA graph (`AttentionMetadata.mixed`): launch shapes
    # that do not depend on the step's composition.
    mixed_graphs: bool = False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Return the attention output, [T, num_heads, head_dim]."""

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        """Store new K/V at their slots without attending (what `forward` does first)."""
        write_kv(k, v, k_cache, v_cache, slot_mapping)

    def warm_up(self, num_heads: int, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> int:
        """Prepare every kernel variant this model shape can need (compiled backends), so
        that no step waits for a compiler; returns how many were run. Nothing to do here."""
        return 0


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new K/V at their slots (in place)."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
