"""CUDA graphs of the EAGLE-3 head, keyed by (batch bucket, tokens per request).

One head pass (token embedding, the head's decoder layer over its paged KV, the last row of
each request, draft-vocabulary logits) is a few dozen small kernels; eagerly their launches
cost more than the work at decode batch sizes. Every pass of a proposing step has a static
shape once padded: a draft step is one token per request, and the catch-up extend after a
verify step is at most K+1 tokens per request (padded to the longest). So each (bucket,
tokens) pair gets one graph, captured at start-up into one pool; a pass copies its tensors
into static buffers and replays. Passes without a graph (a long catch-up after prefill or a
pause, more requests than the largest bucket) run eagerly.

Chains: when every request drafts the same k >= 2 tokens greedily (a fixed K, or any K at
batch 1), the whole proposing step is one graph per (bucket, catch-up tokens, k): the
catch-up pass, then k-1 draft passes whose tokens (argmax through d2t), positions and KV
slots are computed on the device, drafts [B, k] out. One replay instead of k.

Padding follows runtime/cuda_graphs.py: padded tokens of a request repeat its last position
and write K/V to scratch page 0; padded requests sit at position 0 on a page table of page 0
only (their draft passes too). Their outputs are never read.

Under overlap scheduling a catch-up may end with the step in flight's tokens, still on the
device (`CatchUpTail`): they are copied into the static input ids there, and the row each
request drafts from moves by the step's accept length, also there.

Catch-ups that only write the head's KV (the pairs a step's prefill chunks completed, the
ride-alongs of plain steps, a wake's bounded passes) have no uniform length, and need no
attention: the head has one layer, so a position's K/V follow from its own inputs
(`Eagle3Head.store_kv`: the norms, the q/k/v projection, the rotary and the store). Their
graphs are keyed by the pass's token count alone, padded to a token bucket (padded tokens
at position 0 write to scratch slot 0), the head's inputs gathered from the feature store
inside the graph. Eagerly each such pass was a whole head layer from Python beside every
step carrying prefill while the drafter is kept up (1.5-2.2 ms of host a step on the
default model, docs/performance.md).
"""

from __future__ import annotations

import bisect
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from specserve.layers.attention import AttentionBackend, AttentionMetadata
from specserve.model.eagle3 import Eagle3Head
from specserve.runtime.cuda_graphs import CaptureReport, capture_graphs, static_meta
from specserve.runtime.inflight import CatchUpTail
from specserve.runtime.packing import Segment
from specserve.speculative.eagle3_graph_inputs import load_catch_up, load_pass


def draft_pass_meta(
    positions: torch.Tensor,
    block_tables: torch.Tensor,
    page_size: int,
    max_seq_len: int,
    query_start: torch.Tensor,
) -> AttentionMetadata:
    """Metadata of a one-token-per-request draft pass at `positions` [B] (on the device),
    with KV slots from the page tables; `query_start` is arange(B + 1). Positions [P, B]
    give the fields of P such passes at once (`chain_pass_metas`)."""
    rows = query_start[:-1]
    return AttentionMetadata(
        positions=positions,
        slot_mapping=block_tables[rows, positions // page_size] * page_size + positions % page_size,
        query_start_loc=query_start,
        seq_lens=positions + 1,
        block_tables=block_tables,
        max_query_len=1,
        max_seq_len=max_seq_len,
    )


def chain_pass_metas(
    last_positions: torch.Tensor,
    passes: int,
    block_tables: torch.Tensor,
    page_size: int,
    max_seq_len: int,
    query_start: torch.Tensor,
) -> list[AttentionMetadata]:
    """The metadata of a chain's `passes` one-token draft passes after the catch-up, whose
    last rows sat at `last_positions` [B]: positions, KV slots and lengths of all passes
    computed together ([passes, B], a handful of kernels for the chain, not per pass)."""
    steps = torch.arange(1, passes + 1, device=last_positions.device)
    positions = last_positions.unsqueeze(0) + steps.unsqueeze(1)
    every = draft_pass_meta(positions, block_tables, page_size, max_seq_len, query_start)
    return [
        replace(
            every,
            positions=every.positions[j],
            slot_mapping=every.slot_mapping[j],
            seq_lens=every.seq_lens[j],
        )
        for j in range(passes)
    ]


class DrafterGraphs:
    """Captures one EAGLE-3 head pass per (batch bucket, tokens per request) and replays it.

    `run(segments, hidden, input_ids)` returns (head output at each segment's last token
    [B, H], draft-vocabulary logits of those rows [B, V_draft]); `run_chain(segments, hidden,
    k)` the k greedy drafts [B, k] (target ids) of a whole proposing step (`chain_lengths`
    lists the k captured, for buckets up to `chain_max_batch` and catch-ups up to k+1 tokens:
    larger batches rarely speculate). Outputs are views into graph memory valid until the
    next call. With a `feature_store` and token buckets (`catch_up_tokens`),
    `run_catch_up(segments, tail)` runs a catch-up pass of any lengths that only writes the
    head's KV (`catch_up_bucket` says which fit).
    With `use_graphs=False` the same padded static buffers go through the eager head (for
    debugging, and for testing the padding on the CPU).
    """

    def __init__(
        self,
        head: Eagle3Head,
        embed: nn.Embedding,
        kv_layer: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        batch_buckets: tuple[int, ...],
        tokens_per_request: tuple[int, ...],
        max_seq_len: int,
        use_graphs: bool = True,
        chain_lengths: tuple[int, ...] = (),
        chain_max_batch: int = 64,
        feature_store: torch.Tensor | None = None,
        catch_up_tokens: tuple[int, ...] = (),
    ):
        self.head, self.embed, self.kv_layer, self.backend = head, embed, kv_layer, backend
        self.batch_buckets = tuple(sorted(set(batch_buckets)))
        self.tokens_per_request = tuple(sorted(set(tokens_per_request)))
        self.max_seq_len = max_seq_len
        self.use_graphs = use_graphs
        self.chain_lengths = tuple(sorted(k for k in set(chain_lengths) if k >= 2))
        self.chain_max_batch = chain_max_batch
        self.feature_store = feature_store  # [slots, H]: catch-up inputs by KV slot
        device = kv_layer[0].device
        self.page_size = kv_layer[0].shape[1]
        max_b, max_q = self.batch_buckets[-1], self.tokens_per_request[-1]
        self.max_pages = -(-max_seq_len // self.page_size)
        i64 = dict(dtype=torch.int64, device=device)
        # catch-up passes' token buckets (they read their inputs from the store)
        self.catch_up_tokens = (
            tuple(sorted(set(catch_up_tokens))) if feature_store is not None else ()
        )
        # The per-pass integers are sections of one buffer, filled by one copy per pass:
        # seq_lens, last_rows [max_b]; input_ids, positions, slot_mapping, and a catch-up
        # tail's destination and source rows [n_max] (page tables apart: their width
        # varies).
        n_max = max((max_b * max_q, *self.catch_up_tokens))
        sizes = (max_b, max_b, n_max, n_max, n_max, n_max, n_max)
        self.ints = torch.zeros(sum(sizes), **i64)
        (
            self.seq_lens,
            self.last_rows,
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.tail_dest,
            self.tail_src,
        ) = self.ints.split(sizes)
        self._offsets = np.cumsum((0,) + sizes)[:-1].tolist()
        self.seq_lens.fill_(1)
        self.block_tables = torch.zeros(max_b, self.max_pages, **i64)
        self.query_start = {
            q: torch.arange(max_b + 1, **i64) * q for q in {1, *self.tokens_per_request}
        }  # 1: chains' draft passes
        hidden_size = head.config.layer.hidden_size
        self.hidden = torch.zeros(
            max_b * max_q, hidden_size, dtype=head.fc.weight.dtype, device=device
        )
        # draft id -> target id, one gather (d2t applied once here)
        self.draft_ids = head.draft_to_target(
            torch.arange(head.config.draft_vocab_size, device=device)
        )
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.report: CaptureReport | None = None

    @property
    def static_bytes(self) -> int:
        bufs = [self.ints, self.block_tables, self.hidden, *self.query_start.values()]
        return sum(b.numel() * b.element_size() for b in bufs)

    def keys(self) -> list[tuple[int, int, int]]:
        """Every (batch bucket, tokens per request, chain drafts or 0 for one pass) and
        (0, 0, token bucket) of a catch-up pass, largest first."""
        keys = [(b, q, 0) for b in self.batch_buckets for q in self.tokens_per_request]
        keys += [
            (b, q, k)
            for k in self.chain_lengths
            for b in self.batch_buckets
            for q in self.tokens_per_request
            if b <= self.chain_max_batch and q <= k + 1
        ]
        keys += [(0, 0, t) for t in self.catch_up_tokens]

        def size(key):
            b, q, k = key
            return (b * q, q, k) if q else (k, 0, 0)

        return sorted(keys, key=size, reverse=True)

    def bucket_for(self, num_requests: int) -> int:
        return self.batch_buckets[bisect.bisect_left(self.batch_buckets, num_requests)]

    def length_for(self, num_tokens: int) -> int | None:
        """The captured tokens per request a segment of num_tokens pads to (None: none)."""
        i = bisect.bisect_left(self.tokens_per_request, num_tokens)
        return self.tokens_per_request[i] if i < len(self.tokens_per_request) else None

    def can_run(self, segments: list[Segment]) -> bool:
        """Whether this pass has a graph: a bucket for its requests, a captured length its
        longest segment pads to, contexts within max_seq_len and page tables within
        max_pages."""
        if not 0 < len(segments) <= self.batch_buckets[-1]:
            return False
        return (
            self.length_for(max(len(s.token_ids) for s in segments)) is not None
            and min(len(s.token_ids) for s in segments) > 0
            and max(s.start + len(s.token_ids) for s in segments) <= self.max_seq_len
            and max(len(s.page_table) for s in segments) <= self.max_pages
        )

    def can_run_chain(self, segments: list[Segment], k: int) -> bool:
        """Whether a chain of k drafts has a graph, its draft positions within max_seq_len
        and each request's pages."""
        if (
            k not in self.chain_lengths
            or not self.can_run(segments)
            or self.bucket_for(len(segments)) > self.chain_max_batch
            or self.length_for(max(len(s.token_ids) for s in segments)) > k + 1
        ):
            return False
        ends = [s.start + len(s.token_ids) + k - 1 for s in segments]  # last draft pos + 1
        return max(ends) <= self.max_seq_len and all(
            -(-end // self.page_size) <= len(s.page_table) for s, end in zip(segments, ends)
        )

    def catch_up_bucket(self, num_tokens: int) -> int | None:
        """The token bucket a catch-up pass of num_tokens tokens pads to (None: none)."""
        i = bisect.bisect_left(self.catch_up_tokens, num_tokens)
        return self.catch_up_tokens[i] if i < len(self.catch_up_tokens) else None

    @property
    def max_catch_up_tokens(self) -> int:
        """The most tokens a catch-up graph takes (0: none captured)."""
        return self.catch_up_tokens[-1] if self.catch_up_tokens else 0

    @torch.inference_mode()
    def run_catch_up(self, segments: list[Segment], tail: CatchUpTail | None = None) -> None:
        """A catch-up pass over `segments` (a `catch_up_bucket` for their tokens; with a
        `tail`, the step in flight's tokens end them, placed on the device) that only writes
        the head's KV: staged padded to its bucket, its graph replayed."""
        tokens = load_catch_up(self, segments, tail)
        self._replay(0, 0, tokens)

    def _forward_catch_up(self, tokens: int) -> tuple:
        """The staged catch-up's K/V stores, its inputs gathered from the feature store by
        KV slot (padding: scratch slot 0); it keeps no output."""
        slots = self.slot_mapping[:tokens]
        self.head.store_kv(
            self.embed(self.input_ids[:tokens]),
            self.feature_store[slots],
            self.positions[:tokens],
            slots,
            self.kv_layer,
            self.backend,
        )
        return ()

    def _pass(self, batch: int, q: int, with_normed: bool = False):
        """The head pass over the loaded inputs (see Eagle3Head.forward's `with_normed`)."""
        n = batch * q
        meta = static_meta(self, batch, q)
        embeds = self.embed(self.input_ids[:n])
        return self.head(embeds, self.hidden[:n], meta, self.kv_layer, self.backend, with_normed)

    def _forward(self, batch: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        last = self._pass(batch, q)[self.last_rows[:batch]]
        return last, self.head.compute_logits(last)

    def _forward_chain(self, batch: int, q: int, k: int) -> tuple[torch.Tensor]:
        """The catch-up pass, then k-1 one-token passes fed with their own greedy drafts
        (argmax over the activation-dtype logits: their fp32 copy would not change it; each
        pass's last residual add inside its final norm)."""
        rows = self.last_rows[:batch]
        out, normed = self._pass(batch, q, with_normed=True)
        last = out[rows]
        drafts = [self.draft_ids[self.head.greedy_normed(normed[rows])]]
        metas = chain_pass_metas(
            self.positions[rows],
            k - 1,
            self.block_tables[:batch],
            self.page_size,
            self.max_seq_len,
            self.query_start[1][: batch + 1],
        )
        for meta in metas:
            last, normed = self.head(
                self.embed(drafts[-1]), last, meta, self.kv_layer, self.backend, with_normed=True
            )
            drafts.append(self.draft_ids[self.head.greedy_normed(normed)])
        return (torch.stack(drafts, dim=1),)

    def _run_key(self, batch: int, q: int, k: int) -> tuple:
        if q == 0:  # (0, 0, tokens): a catch-up pass
            return self._forward_catch_up(k)
        return self._forward_chain(batch, q, k) if k else self._forward(batch, q)

    def capture(self, pool=None) -> CaptureReport:
        """Capture every shape into `pool` or a new one (the engine gives the drafter its own
        pool, apart from the target's); see `capture_graphs`."""
        if not self.use_graphs:
            self.report = CaptureReport(0, 0.0, 0.0, 0, self.static_bytes)
            return self.report
        self._graphs, self.report, self.pool = capture_graphs(
            self.keys(), self._run_key, self.static_bytes, pool
        )
        return self.report

    @torch.inference_mode()
    def run(
        self,
        segments: list[Segment],
        hidden: torch.Tensor | None,
        input_ids: torch.Tensor | None = None,
        tail: CatchUpTail | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head pass over `segments` (their token ids, or `input_ids` [sum of lengths] on
        the device, or with a device `tail`) with head inputs `hidden` [sum of lengths, H],
        in segment order, or (None) gathered from `feature_store` by KV slot."""
        num_requests, batch, q = self._load(segments, hidden, input_ids, tail)
        last, logits = self._replay(batch, q, 0)
        return last[:num_requests], logits[:num_requests]

    @torch.inference_mode()
    def run_chain(
        self,
        segments: list[Segment],
        hidden: torch.Tensor | None,
        k: int,
        tail: CatchUpTail | None = None,
    ) -> torch.Tensor:
        """A whole greedy proposing step: the catch-up pass over `segments` and `hidden` (or
        the feature store, as in `run`), then k-1 draft passes; returns the drafts [B, k]
        (target ids) on the device."""
        num_requests, batch, q = self._load(segments, hidden, None, tail)
        (drafts,) = self._replay(batch, q, k)
        return drafts[:num_requests]

    def last_positions(self, num_requests: int) -> torch.Tensor:
        """Positions of the rows the last `run` drafted from (on the device)."""
        return self.positions[self.last_rows[:num_requests]]

    @torch.inference_mode()
    def run_step(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-token draft pass of the requests of the last `run` (their page tables are
        still loaded) at `positions` on the device, fed `tokens` and `hidden` [B, H]: for
        chains whose positions only the device knows, when no chain graph fits."""
        n = tokens.shape[0]
        batch = self.bucket_for(n)
        self.input_ids[:n].copy_(tokens)
        self.hidden[:n].copy_(hidden)
        self.positions[:n].copy_(positions)
        self.positions[n:batch] = 0  # padded requests: position 0 on page 0
        meta = draft_pass_meta(
            self.positions[:batch],
            self.block_tables[:batch],
            self.page_size,
            self.max_seq_len,
            self.query_start[1][: batch + 1],
        )
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.last_rows[:batch].copy_(self.query_start[1][:batch])
        last, logits = self._replay(batch, 1, 0)
        return last[:n], logits[:n]

    def _replay(self, batch: int, q: int, k: int) -> tuple:
        if not self.use_graphs:
            return self._run_key(batch, q, k)
        graph, outputs = self._graphs[(batch, q, k)]
        graph.replay()
        return outputs

    def _load(self, segments, hidden, input_ids, tail=None) -> tuple[int, int, int]:
        return load_pass(self, segments, hidden, input_ids, tail)
