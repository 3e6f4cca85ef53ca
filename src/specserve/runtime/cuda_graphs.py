"""CUDA graphs of the target forward, keyed by (batch-size bucket, tokens per request), and
of mixed steps, keyed by (request bucket, token bucket).

Decode (1 token per request) and verify (K+1 tokens per request) steps have static shapes once
the batch is padded to a bucket, so each (bucket, tokens) pair gets one graph, captured at
start-up into one shared memory pool. A step copies its tensors into static input buffers
and replays the graph of its shape; nothing is captured or allocated afterwards.

A step that carries prefill chunks beside its decode and verify rows (a "mixed" step: under
load, every request that joins brings one) has no uniform shape; eagerly it costs the host
a launch per kernel, which on a small model is several times the device's time (16-27 ms
against ~1-3 ms for the default model's 30 layers on the H200). Its graphs are keyed by the
step's token count, padded to a token bucket, and its request count, padded to a request
bucket: the dense layers see the padded tokens, and attention takes the step's composition
from the device (`layers.attention.MixedLayout`): the leading short rows through the decode
path, the prefill chunks' row blocks through a tile list.

Padding is harmless by construction: padded requests and tokens sit at position 0 with
seq_len 1, write their K/V to slot 0 of page 0 (the scratch page the allocator never lends)
and attend only to that slot (a mixed step's padded tokens belong to its last padded
request).
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from specserve.core.graph_timing import no_collection_while_capturing
from specserve.layers.attention import AttentionBackend, AttentionMetadata
from specserve.layers.attention.base import MixedLayout, max_mixed_tiles, mixed_tiles
from specserve.runtime.graph_shapes import mixed_keys
from specserve.runtime.graph_staging import stage_step, use_stage_kernel
from specserve.runtime.packing import staging_int64

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class CaptureReport:
    """What start-up capture cost: graphs, wall time, and device memory."""

    num_graphs: int
    warmup_s: float  # eager runs of every shape first (Triton compilation, cuBLAS set-up)
    capture_s: float
    graph_pool_bytes: int  # growth of reserved device memory over the captures
    static_bytes: int  # the static input buffers
    first_replay_s: float = 0.0  # one replay of every graph after capture (see capture_graphs)


def static_meta(bufs, batch: int, q_len: int) -> AttentionMetadata:
    """Attention metadata of `batch` requests of q_len tokens each over the static buffers of
    a graph runner (`positions`, `slot_mapping`, `query_start` by q_len, `seq_lens`,
    `block_tables`, `max_seq_len`): views, so a captured graph reads what each step copies in."""
    n = batch * q_len
    return AttentionMetadata(
        positions=bufs.positions[:n],
        slot_mapping=bufs.slot_mapping[:n],
        query_start_loc=bufs.query_start[q_len][: batch + 1],
        seq_lens=bufs.seq_lens[:batch],
        block_tables=bufs.block_tables[:batch],
        max_query_len=q_len,
        max_seq_len=bufs.max_seq_len,
    )


@torch.inference_mode()
def capture_graphs(keys: list[tuple], forward, static_bytes: int, pool=None):
    """Run `forward(*key)` eagerly for every key (Triton compilation, cuBLAS set-up) on a side
    stream, then capture each into one memory pool (`pool`, or a new one), in the order
    given (largest first, so that smaller graphs reuse its memory), then replay each once:
    a graph's first launch also uploads it to the device, work that would otherwise fall on
    the first step to reach its shape (on the H200 the 32 replays of an 8B-shaped engine take
    0.15 s, about one step's run each; the upload was not timed apart). The static buffers
    hold padding values while this runs, so every write goes to the scratch page 0.
    Returns ({key: (graph, outputs)}, the report, the pool)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for key in keys:
            forward(*key)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    gc.collect()  # free dropped engines' graphs and memory before, not during, the captures
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    start = time.perf_counter()
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    graphs = {}
    with no_collection_while_capturing():
        for key in keys:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = forward(*key)
            graphs[key] = (graph, outputs)
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - start
    start = time.perf_counter()
    for graph, _ in graphs.values():
        graph.replay()
    torch.cuda.synchronize()
    report = CaptureReport(
        num_graphs=len(keys),
        warmup_s=warmup_s,
        capture_s=capture_s,
        graph_pool_bytes=torch.cuda.memory_reserved() - reserved,
        static_bytes=static_bytes,
        first_replay_s=time.perf_counter() - start,
    )
    return graphs, report, pool


class CudaGraphRunner:
    """Captures `model.forward` per (batch bucket, q_len: tokens per request) and replays it.

    `run(input_ids, meta)` serves any step whose requests all have the same query length
    q_len (in `q_lens`), at most the largest bucket of requests, and contexts up to
    `max_seq_len`. Its outputs are views into graph memory, valid until the next `run`.
    With `use_graphs=False` the same padded static buffers go through the eager forward
    (for debugging, and for testing the padding on the CPU).

    `feature_writer(aux, slots)` (the drafter's, when it keeps its inputs itself, e.g.
    EAGLE-3's fc projection into its feature store) runs inside each graph on the step's
    auxiliary hidden states and the static slot mapping (padding rows: scratch page 0), so
    a step that does not draft is one replay, as a plain step; `run` then returns no aux.

    `logits_head(hidden)` (the model's logits in the activation dtype, when given) runs inside
    each graph too, with the row argmax of its logits (the Triton kernels while capturing,
    kernels/triton_argmax.py): after `run`, `last_head` holds the real rows' (logits, greedy
    tokens), views of graph memory that the next replay overwrites, and for steps of q_len > 1
    tokens per request each request's greedy accept length (`greedy_accept_lens`: its drafts,
    the input rows after the first, accepted while they equal the argmax of the row before).
    A greedy decode step without logprobs then samples without launching anything more, and
    so does a greedy verify step whose requests all draft q_len - 1; other steps (sampled,
    logprobs, shorter drafts) read the logits from there instead of projecting again.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_layers: KVLayers,
        backend: AttentionBackend,
        batch_buckets: tuple[int, ...],
        q_lens: tuple[int, ...] = (1,),
        max_seq_len: int = 4096,
        aux_layer_ids: tuple[int, ...] = (),
        use_graphs: bool = True,
        feature_writer: Callable[[list[torch.Tensor], torch.Tensor], None] | None = None,
        logits_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        mixed_requests: tuple[int, ...] = (),
        mixed_tokens: tuple[int, ...] = (),
    ):
        self.model, self.kv_layers, self.backend = model, kv_layers, backend
        self.batch_buckets = tuple(sorted(set(batch_buckets)))
        self.q_lens = tuple(sorted(set(q_lens)))
        self.max_seq_len = max_seq_len
        self.aux_layer_ids = aux_layer_ids
        self.use_graphs = use_graphs
        self.feature_writer = feature_writer
        self.logits_head = logits_head
        self.last_head: tuple[torch.Tensor, ...] | None = None  # see above
        self.mixed_requests = tuple(sorted(set(mixed_requests))) if mixed_tokens else ()
        self.mixed_tokens = tuple(sorted(set(mixed_tokens))) if mixed_requests else ()
        device = kv_layers[0][0].device
        page_size = kv_layers[0][0].shape[1]
        max_b, max_q_len = self.batch_buckets[-1], self.q_lens[-1]
        self.max_pages = -(-max_seq_len // page_size)
        max_r = max((max_b, *self.mixed_requests))
        max_t = max((max_b * max_q_len, *self.mixed_tokens))
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_t, **i64)
        self.positions = torch.zeros(max_t, **i64)
        self.slot_mapping = torch.zeros(max_t, **i64)
        self.seq_lens = torch.ones(max_r, **i64)
        self.block_tables = torch.zeros(max_r, self.max_pages, **i64)
        self.query_start = {q_len: torch.arange(max_b + 1, **i64) * q_len for q_len in self.q_lens}
        # A mixed step's host-built integers (MixedLayout), one copy: its query starts, its
        # short rows' starts and its tile list, laid out per graph from offset 0.
        self.group = model.config.num_heads // model.config.num_kv_heads
        # the short rows a mixed step's decode-path launch serves: decode and verify rows
        self.short_query_len = max_q_len
        most = [2 * (b + 1) + 2 * max_mixed_tiles(t, b, self.group) for b, t in self.mixed_keys()]
        self.mixed_block = torch.zeros(max(most, default=0), **i64)
        self._graphs: dict[tuple, tuple] = {}  # key -> (graph, hidden, aux, head)
        self.report: CaptureReport | None = None

    @property
    def static_bytes(self) -> int:
        bufs = [
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.seq_lens,
            self.block_tables,
            *self.query_start.values(),
            self.mixed_block,
        ]
        return sum(b.numel() * b.element_size() for b in bufs)

    def mixed_keys(self) -> list[tuple[int, int]]:
        """Every (request bucket, token bucket) of mixed steps."""
        return mixed_keys(self.mixed_requests, self.mixed_tokens)

    def keys(self) -> list[tuple]:
        """Every (batch bucket, q_len) and (request bucket, 0, token bucket) of a mixed step,
        largest step first."""
        keys = [(b, q_len) for b in self.batch_buckets for q_len in self.q_lens]
        keys += [(b, 0, t) for b, t in self.mixed_keys()]

        def size(key):
            return (key[0] * key[1], key[1]) if len(key) == 2 else (key[2], key[0])

        return sorted(keys, key=size, reverse=True)

    def bucket_for(self, num_requests: int) -> int:
        return self.batch_buckets[bisect.bisect_left(self.batch_buckets, num_requests)]

    def mixed_bucket_for(self, num_requests: int, num_tokens: int) -> tuple[int, int] | None:
        """The mixed graph's (request bucket, token bucket) of a step, or None: beyond them."""
        b = bisect.bisect_right(self.mixed_requests, num_requests)  # above: one padded
        t = bisect.bisect_left(self.mixed_tokens, num_tokens)
        if b == len(self.mixed_requests) or t == len(self.mixed_tokens):
            return None
        return self.mixed_requests[b], self.mixed_tokens[t]

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step has a graph: uniform query length q_len (B * q_len == tokens)
        with a captured q_len, a bucket for B, and contexts within max_seq_len."""
        q_len, num_requests = meta.max_query_len, meta.num_requests
        return (
            q_len in self.query_start
            and 0 < num_requests <= self.batch_buckets[-1]
            and num_requests * q_len == num_tokens
            and meta.max_seq_len <= self.max_seq_len
            and meta.block_tables.shape[1] <= self.max_pages
        )

    def can_run_mixed(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step has a mixed graph: its host query lengths known (packed by the
        runner), buckets for its requests and tokens, contexts within max_seq_len."""
        return (
            meta.prefill  # (decode and verify steps: uniform graphs, or eager)
            and meta.query_lens is not None
            and self.mixed_bucket_for(meta.num_requests, num_tokens) is not None
            and meta.max_seq_len <= self.max_seq_len
            and meta.block_tables.shape[1] <= self.max_pages
        )

    def _mixed_views(self, batch: int, tokens: int):
        """The mixed block's (query starts [B+1], short starts [B+1], tiles [N, 2]) of the
        graph (batch, tokens)."""
        count = max_mixed_tiles(tokens, batch, self.group)
        qsl, short, tiles = self.mixed_block[: 2 * (batch + 1) + 2 * count].split(
            [batch + 1, batch + 1, 2 * count]
        )
        return qsl, short, tiles.view(count, 2)

    def _mixed_meta(self, batch: int, tokens: int) -> AttentionMetadata:
        qsl, short, tiles = self._mixed_views(batch, tokens)
        short_tokens = min(batch * self.short_query_len, tokens)
        return AttentionMetadata(
            positions=self.positions[:tokens],
            slot_mapping=self.slot_mapping[:tokens],
            query_start_loc=qsl,
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            max_query_len=tokens,
            max_seq_len=self.max_seq_len,
            mixed=MixedLayout(short, self.short_query_len, short_tokens, tiles),
            prefill=True,  # (decode and verify steps are padded to uniform graphs)
        )

    def _stage_mixed(self, meta: AttentionMetadata, batch: int, tokens: int) -> None:
        """The host half of a mixed step's staging: query starts (the padded tokens go to
        the last padded request), the short rows' starts and the tile list, one copy."""
        query_lens, n = meta.query_lens, meta.num_requests
        short = 0  # leading requests of decode and verify length
        while short < n and query_lens[short] <= self.short_query_len:
            short += 1
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        starts += [starts[-1]] * (batch - n - 1) + [tokens]
        short_starts = starts[: short + 1] + [starts[short]] * (batch - short)
        count = max_mixed_tiles(tokens, batch, self.group)
        values = starts + short_starts + mixed_tiles(query_lens, short, self.group, count)
        host_view, host = staging_int64(len(values), self.mixed_block.device)
        host_view[:] = values
        self.mixed_block[: len(values)].copy_(host, non_blocking=True)

    def _forward(self, batch: int, q_len: int, tokens: int = 0):
        """The graphed forward of (batch, q_len), or with q_len = 0 of a mixed step of `tokens`."""
        if q_len == 0:
            meta = self._mixed_meta(batch, tokens)
            ids = self.input_ids[:tokens]
        else:
            meta = static_meta(self, batch, q_len)
            ids = self.input_ids[: batch * q_len]
        hidden, aux = self.model(ids, meta, self.kv_layers, self.backend, self.aux_layer_ids)
        if aux and self.feature_writer is not None:
            self.feature_writer(aux, meta.slot_mapping)
        if q_len == 0:  # its logits are projected after it, for the rows that sample
            return hidden, aux if self.feature_writer is None else [], None
        head = None
        if self.logits_head is not None:
            from specserve.layers.sampler import argmax_rows
            from specserve.runtime.verify import greedy_accept_lens

            logits = self.logits_head(hidden)
            tokens = argmax_rows(logits)
            head = (logits, tokens)
            if q_len > 1:  # a verify step: its greedy accept lengths too
                head += (greedy_accept_lens(ids.view(batch, q_len), tokens.view(batch, q_len)),)
        return hidden, aux, head

    def capture(self, pool=None) -> CaptureReport:
        """Capture every (bucket, q_len) shape into `pool` or a new one (the engine keeps
        the target's and the drafter's graphs in separate pools: their outputs may be alive
        at the same time); see `capture_graphs`."""
        device = self.input_ids.device
        if use_stage_kernel(device):  # compiled now, not at the first step
            from specserve.runtime import stage_kernel

            stage_kernel.warm_up(device)
        if not self.use_graphs:
            self.report = CaptureReport(0, 0.0, 0.0, 0, self.static_bytes)
            return self.report
        graphs, self.report, self.pool = capture_graphs(
            self.keys(), self._forward, self.static_bytes, pool
        )
        self._graphs = {key: (graph, *out) for key, (graph, out) in graphs.items()}
        return self.report

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Copy the step into the static buffers (padding the batch to its bucket), replay
        its graph; return the hidden states (and aux hidden states, unless the graph gave
        them to `feature_writer`) of the real tokens."""
        num_requests, q_len = meta.num_requests, meta.max_query_len
        n, batch = num_requests * q_len, self.bucket_for(num_requests)
        # one launch on CUDA (graph_staging.py)
        stage_step(self, input_ids, meta, batch, batch * q_len)
        if self.use_graphs:
            graph, hidden, aux, head = self._graphs[(batch, q_len)]
            graph.replay()
        else:
            hidden, aux, head = self._forward(batch, q_len)
        self._lookups_as_captured(batch)
        self.last_head = (
            None
            if head is None
            else (head[0][:n], head[1][:n], *(lens[:num_requests] for lens in head[2:]))
        )
        if self.feature_writer is not None:
            return hidden[:n], []
        return hidden[:n], [a[:n] for a in aux]

    def _lookups_as_captured(self, step_requests: int | None) -> None:
        """Logits projected after a replay (eagerly: a mixed step's, fp32 ones) look their
        GEMVs up as the graph's forward did (`GemvPlan.step_requests`, which the model's
        forward sets and a replay, running no Python, does not): by the graph's request
        bucket, or by row count after a step carrying prefill."""
        plan = getattr(self.model, "gemv_plan", None)
        if plan is not None:
            plan.step_requests = step_requests

    @torch.inference_mode()
    def run_mixed(
        self, input_ids: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`run` for a step `can_run_mixed` accepts: staged into the buffers padded to its
        (request, token) buckets, its graph replayed; no logits are taken inside."""
        n = input_ids.shape[0]
        batch, tokens = self.mixed_bucket_for(meta.num_requests, n)
        stage_step(self, input_ids, meta, batch, tokens)
        self._stage_mixed(meta, batch, tokens)
        if self.use_graphs:
            graph, hidden, aux, _ = self._graphs[(batch, 0, tokens)]
            graph.replay()
        else:
            hidden, aux, _ = self._forward(batch, 0, tokens)
        self._lookups_as_captured(None)
        self.last_head = None
        return hidden[:n], [a[:n] for a in aux]
