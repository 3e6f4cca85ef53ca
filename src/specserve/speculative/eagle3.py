"""EAGLE-3 drafting: the head reads the target's low/mid/high features and its own outputs.

Head position i holds the pair (target feature of token i, embedding of token i+1) and
predicts token i+2. Every target pass projects the features of all its tokens by the head's
fc into a store indexed like the KV cache (`feature_store[slot]`, the slot of the token's
position in the request's pages), one copy per step, with no per-request work: a position's
feature is written by the step that feeds its token, and a rejected draft's is overwritten
by the step that feeds the real token there, as its KV is. The next proposing step first
runs the head over the pairs its drafter has not seen (the catch-up: one batched extend over
everything committed since it last drafted, however long the request went without
speculating), reading their features from the store by slot; its last output yields draft
1; each further draft feeds the head's own output and the previous draft back in. The
head's KV lives in the request's pages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specserve.core.batch import ScheduledRequest
from specserve.core.errors import drafter_errors
from specserve.core.kv_cache import KVCache
from specserve.core.parallel import SINGLE_RANK
from specserve.layers.attention import AttentionBackend
from specserve.layers.sampler import argmax_rows
from specserve.model.eagle3 import Eagle3Head, load_eagle3_head
from specserve.runtime.inflight import InflightStep
from specserve.runtime.packing import Segment, pack, to_device, upload
from specserve.speculative.eagle3_capture import (  # noqa: F401 (catch_up_lengths: imported from here)
    capture_drafter_graphs,
    catch_up_lengths,
)
from specserve.speculative.eagle3_graphs import DrafterGraphs, draft_pass_meta
from specserve.speculative.proposer import Proposer, bounded_passes, chain_draft, draw_drafts

if TYPE_CHECKING:
    from specserve.speculative.target import TargetParts

# A request that goes this many generated tokens without drafting brings its drafter up to
# date in that step (ride-along), so that the catch-up when drafting resumes stays short;
# every other request with at least 1/RIDE_ALONG_JOIN of that unseen joins the same pass.
CATCH_UP_STEPS = 128
RIDE_ALONG_JOIN = 4


def ride_alongs(unseen: list[int]) -> list[bool]:
    """Which requests, by the generated tokens their drafter has not seen (`unseen`), bring
    it up to date in this step: none until one reaches CATCH_UP_STEPS, then every one with
    at least CATCH_UP_STEPS / RIDE_ALONG_JOIN. One pass for many: each request reaching the
    bound on its own step ran its own eager pass, and on the default model at 64 requests
    (H100, plain steps with the drafter kept up) that was a pass every other step at ~0.7
    ms of host each: 0.80 of speculation off's throughput (0.72 at 32)."""
    if not unseen or max(unseen) < CATCH_UP_STEPS:
        return [False] * len(unseen)
    join = max(1, CATCH_UP_STEPS // RIDE_ALONG_JOIN)
    return [u >= join for u in unseen]


class Eagle3Proposer(Proposer):
    """Chain drafting with an EAGLE-3 head (one token per draft step).

    `graphs` (DrafterGraphs, set on CUDA) runs every head pass that has a captured shape;
    greedy drafts are the argmax over the draft vocabulary mapped through d2t, so only
    sampled requests pay for logits over the whole target vocabulary."""

    needs_commit = False  # features reach the store at launch; nothing to queue
    reads_next_token = True  # head position i pairs token i's feature with token i + 1

    def __init__(self, head: Eagle3Head, embed: torch.nn.Embedding, kv: KVCache, backend):
        self.head, self.embed, self.kv = head, embed, kv
        self.backend: AttentionBackend = backend
        self.aux_layer_ids = head.aux_layer_ids
        self.target_vocab = head.config.vocab_size
        self.draft_ids = head.draft_to_target(
            torch.arange(head.config.draft_vocab_size, device=head.d2t.device)
        )
        self.graphs: DrafterGraphs | None = None
        # Projected target features by KV slot: [pages * page size, H] (page 0: scratch).
        num_slots = kv.pool.shape[2] * kv.page_size
        self.feature_store = torch.zeros(
            num_slots,
            head.config.layer.hidden_size,
            dtype=head.fc.weight.dtype,
            device=kv.pool.device,
        )

    def _target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits -> logits over the target vocabulary (-inf outside)."""
        full = torch.full(
            (draft_logits.shape[0], self.target_vocab), float("-inf"), device=draft_logits.device
        )
        full[:, self.draft_ids] = draft_logits
        return full

    def _draw(self, draft_logits: torch.Tensor, items: list[ScheduledRequest], step: int):
        if all(it.request.params.temperature == 0 for it in items):
            return self.draft_ids[argmax_rows(draft_logits)], None
        return draw_drafts(self._target_logits(draft_logits), items, step)

    def _pass(
        self,
        segments: list[Segment],
        hidden: torch.Tensor | None,
        input_ids=None,
        logits: bool = True,
    ):
        """One head pass: (output at each segment's last token, its draft logits or None).
        `hidden` None: the catch-up's features, read from the store by slot."""
        if self.graphs is not None and self.graphs.can_run(segments):
            return self.graphs.run(segments, hidden, input_ids)
        if not logits and hidden is None and input_ids is None:
            self._catch_up_only(segments)
            return None, None
        ids, meta, last_rows = pack(segments, self.kv.page_size, self.kv.pool.device)
        self.count_eager(len(ids))
        if hidden is None:
            hidden = self.feature_store[meta.slot_mapping]
        embeds = self.embed(ids if input_ids is None else input_ids)
        out = self.head(embeds, hidden, meta, self.kv.layers[0], self.backend)
        last = out[to_device(last_rows, out.device)]
        return last, self.head.compute_logits(last) if logits else None

    def reads_inflight(self, items: list[ScheduledRequest]) -> bool:
        """Whether `propose` can take the step in flight's tokens from the device for these
        items: greedy, one draft length for all (the device chain)."""
        draft_len = items[0].draft_len
        return all(it.draft_len == draft_len and it.request.params.temperature == 0 for it in items)

    @torch.inference_mode()
    def propose(self, items: list[ScheduledRequest], prev: InflightStep | None = None) -> None:
        """Catch up and draft. Greedy steps with one draft length leave the drafts on the
        device (`device_drafts`); with `prev`, the step in flight, a request's newest tokens
        and features are read from it on the device (`reads_inflight` must hold)."""
        self._bound_catch_up(items, prev)
        segments, tail = self._catch_up_inputs(items, prev)
        if self.reads_inflight(items):
            drafts = self._greedy_chain(segments, tail, items[0].draft_len)
            for row, it in enumerate(items if drafts is not None else ()):
                it.device_drafts = (drafts, row)
            return
        if tail is not None:
            raise RuntimeError("only greedy steps of one draft length read the step in flight")
        drafting = [i for i, it in enumerate(items) if it.draft_len > 0]
        last, logits = self._pass(segments, None, logits=bool(drafting))
        if not drafting:
            return  # a catch-up pass only
        if len(drafting) < len(items):
            index = to_device(drafting, last.device)
            last, logits = last[index], logits[index]
        state = {"last": last}

        def step(active, tokens, positions, index):
            # Draft j sits at position committed_len - 2 + j, fed with the head's own output.
            segs = [Segment(it.request.page_table, pos, [0]) for it, pos in zip(active, positions)]
            state["last"], step_logits = self._pass(segs, state["last"][index], tokens)
            return step_logits

        chain_draft([items[i] for i in drafting], logits, step, self._draw)

    def _bound_catch_up(self, items: list[ScheduledRequest], prev: InflightStep | None) -> None:
        """When the step's catch-up would pass `max_pass_tokens`, or a request's is longer
        than the uniform graphs take while catch-up graphs are captured (the first drafting
        step after plain ones, a wake), the pairs of committed tokens before each request's
        last one run first, in bounded passes (no logits); the step's own pass then takes
        one host pair and the step in flight's tokens per request, a captured shape."""
        max_draft_len = max(it.draft_len for it in items)
        pending = sum(it.request.drafter_backlog for it in items)
        if pending + len(items) * (max_draft_len + 2) > self.max_pass_tokens or (
            max_draft_len > 0 and self._past_uniform(items, prev)  # (ride-alongs: one pass)
        ):
            self._catch_up_pairs([(it.request, it.request.committed_len - 2) for it in items])

    def _past_uniform(self, items: list[ScheduledRequest], prev: InflightStep | None) -> bool:
        """Whether catch-up graphs are captured and a request's catch-up segment (its
        backlog, then the step in flight's tokens) is longer than any uniform graph's."""
        graphs = self.graphs
        if graphs is None or not graphs.max_catch_up_tokens:
            return False
        rows = prev.rows if prev is not None else {}
        longest = 0
        for it in items:
            # (the backlog counts the step in flight as one token: its tail brings the rest)
            row = rows.get(id(it.request), -1)
            longest = max(
                longest, it.request.drafter_backlog + (prev.drafted[row] if row >= 0 else 0)
            )
        return graphs.length_for(longest) is None

    def _catch_up_pairs(self, ends) -> None:
        """Head passes (no logits, at most `max_pass_tokens` tokens each) over every pair
        from each request's drafter position to `end` (request, end), which becomes its
        drafter position: the pair at `end` is left to the next pass."""
        segments = []
        for req, end in ends:
            start = req.draft_cached_len
            if end > start:
                segments.append(Segment(req.page_table, start, req.token_ids(start + 1, end + 1)))
                req.draft_cached_len = end
        bound = self.max_pass_tokens
        if self.graphs is not None and self.graphs.max_catch_up_tokens:
            bound = min(bound, self.graphs.max_catch_up_tokens)  # each pass a graph's
        for group in bounded_passes(segments, bound):
            self._pass(group, None, logits=False)

    def _catch_up_only(self, segments: list[Segment], tail=None) -> None:
        """A catch-up pass that only writes the head's KV (nobody drafts from it: no
        attention, `Eagle3Head.store_kv`), its inputs read from the feature store; with a
        `tail`, the step in flight's tokens end the segments (their rows filled on the
        device). Through a catch-up graph where one fits (eagle3_graphs.py), else eagerly."""
        graphs = self.graphs
        if graphs is not None and graphs.catch_up_bucket(sum(len(s.token_ids) for s in segments)):
            graphs.run_catch_up(segments, tail)
            return
        device = self.kv.pool.device
        ids, meta, last_rows = pack(segments, self.kv.page_size, device)
        if tail is not None:
            dest, src, _ = tail.index(
                self._starts(last_rows, segments), [len(seg.token_ids) for seg in segments]
            )
            dest_t, src_t = upload([dest, src], device)
            ids[dest_t] = tail.tokens.reshape(-1)[src_t]
        self.count_eager(len(ids))
        slots = meta.slot_mapping
        self.head.store_kv(
            self.embed(ids),
            self.feature_store[slots],
            meta.positions,
            slots,
            self.kv.layers[0],
            self.backend,
        )

    def _catch_up_inputs(self, items, prev: InflightStep | None):
        """Each item's catch-up segment: pairs from its drafter's cached length to its last
        committed token (features from the store); the requests of `prev` end with prev's
        tokens, on the device (`CatchUpTail`)."""
        segments, rows = [], []
        in_prev = prev.rows if prev is not None else {}
        for it in items:
            req = it.request
            start = req.draft_cached_len
            pair_tokens = req.token_ids(start + 1, req.committed_len)
            row = in_prev.get(id(req), -1)
            if row >= 0:  # its newest tokens are in flight: as many as prev may commit
                pair_tokens = pair_tokens + [0] * (prev.drafted[row] + 1)
                prev.consumed.add(id(req))  # prev's resolve adds its accepted drafts
            segments.append(Segment(req.page_table, start, pair_tokens))
            rows.append(row)
            # The host's view (prev counted as one token); prev's resolve adds its accepts.
            req.draft_cached_len = req.committed_len - 1
        tail = prev.catch_up_tail(rows) if any(r >= 0 for r in rows) else None
        return segments, tail

    def _greedy_chain(self, segments, tail, draft_len: int) -> torch.Tensor | None:
        """The catch-up pass, then draft_len - 1 draft passes fed their own argmax drafts,
        at positions computed on the device: drafts [B, draft_len] (target ids) on the
        device, None for draft_len = 0. One replay when a chain graph fits, else a graph or
        eager pass each."""
        graphs = self.graphs
        if graphs is not None and draft_len >= 2 and graphs.can_run_chain(segments, draft_len):
            return graphs.run_chain(segments, None, draft_len, tail)
        if graphs is not None and graphs.can_run(segments):
            last, logits = graphs.run(segments, None, None, tail)
            positions, step = graphs.last_positions(len(segments)), graphs.run_step
        elif draft_len == 0:  # a ride-along: nobody drafts from it
            self._catch_up_only(segments, tail)
            return None
        else:
            last, logits, positions, step = self._eager_catch_up(segments, tail, draft_len)
        if draft_len == 0:
            return None
        drafts = [self.draft_ids[argmax_rows(logits)]]
        for _ in range(draft_len - 1):
            positions = positions + 1
            last, logits = step(drafts[-1], last, positions)
            drafts.append(self.draft_ids[argmax_rows(logits)])
        return torch.stack(drafts, dim=1)

    def _eager_catch_up(self, segments, tail, draft_len: int):
        """The catch-up pass without graphs, for a chain of draft_len >= 1: (output and
        logits at each drafting row, its position, a one-token draft pass at device
        positions for the chain)."""
        device = self.kv.pool.device
        ids, meta, last_rows = pack(segments, self.kv.page_size, device)
        self.count_eager(len(ids))
        hidden = self.feature_store[meta.slot_mapping]
        if tail is not None:
            dest, src, last_rows = tail.index(
                self._starts(last_rows, segments), [len(seg.token_ids) for seg in segments]
            )
            dest_t, src_t, last_t = upload([dest, src, last_rows], device)
            ids[dest_t] = tail.tokens.reshape(-1)[src_t]
            last_t = last_t + tail.accepted
        else:
            last_t = to_device(last_rows, device)
        out = self.head(self.embed(ids), hidden, meta, self.kv.layers[0], self.backend)
        last = out[last_t]
        # Draft passes stay within each request's pages: they cover its chain.
        tables, bound = meta.block_tables, meta.max_seq_len + draft_len - 1
        query_start = torch.arange(len(segments) + 1, device=device)

        def step(tokens, hidden, positions):
            pass_meta = draft_pass_meta(positions, tables, self.kv.page_size, bound, query_start)
            self.count_eager(len(tokens))
            out = self.head(self.embed(tokens), hidden, pass_meta, self.kv.layers[0], self.backend)
            return out, self.head.compute_logits(out)

        return last, self.head.compute_logits(last), meta.positions[last_t], step

    @staticmethod
    def _starts(last_rows: list[int], segments: list[Segment]) -> list[int]:
        return [last - len(seg.token_ids) + 1 for last, seg in zip(last_rows, segments)]

    def catch_up_prefill(self, items: list[ScheduledRequest]) -> None:
        """One head pass over the pairs the prefill chunks completed: each position whose
        next token is in the KV cache too (pair i feeds token i+1). Their features are in
        the store already, written by this step's forward on the same stream. The pair at
        the chunk's last position is left to the next pass, so a request's first drafting
        step catches up exactly one pair (a captured shape) instead of the whole prompt (an
        eager extend), also when the prefill stopped one token short of the end (the next
        step feeds that token as a decode and drafts from the pair before it)."""
        with torch.inference_mode():  # (after a dormant stretch: the whole prompt so far)
            self._catch_up_pairs([(it.request, it.request.cached_len - 1) for it in items])

    def ride_alongs(self, reqs: list) -> list[bool]:
        """Bound the catch-up requests will need: after CATCH_UP_STEPS generated tokens the
        drafter has not seen, the head takes them in this step, with every request near
        that (`ride_alongs`)."""
        return ride_alongs(
            [r.cached_len - max(r.draft_cached_len, len(r.prompt_token_ids)) for r in reqs]
        )

    def features(self, aux: list[torch.Tensor], slots: torch.Tensor | None = None) -> None:
        """Project the step's auxiliary hidden states by the head's fc into the feature
        store at the tokens' KV `slots` (padding rows write to the scratch page 0); graph
        steps did it inside their replay (`feature_writer`) and hand no aux here."""
        if aux:
            with torch.inference_mode():
                self._write_features(aux, slots)
        return None

    def feature_writer(self):
        return self._write_features

    def _write_features(self, aux: list[torch.Tensor], slots: torch.Tensor) -> None:
        """The same ops eagerly and inside the target's graphs: one cat, fc, index copy."""
        x = torch.cat(aux, dim=-1) if len(aux) > 1 else aux[0]
        weight = self.head.fc.weight
        if x.dtype != weight.dtype:
            x = x.to(weight.dtype)
        self.feature_store.index_copy_(0, slots, self.head.project(x))

    def step_timer(self):
        def run(n: int) -> None:
            device = self.kv.pool.device
            segments = [Segment([0], 0, [0]) for _ in range(n)]
            hidden = torch.zeros(
                n,
                self.head.config.layer.hidden_size,
                dtype=self.head.fc.weight.dtype,
                device=device,
            )
            with torch.inference_mode():
                _, logits = self._pass(segments, hidden)
                self.draft_ids[argmax_rows(logits)].tolist()

        return run


def build_eagle3_proposer(target: TargetParts) -> Eagle3Proposer:
    """The head loaded for the engine's target, its projections merged as the target's; on
    CUDA with the Triton backend its norms, rotary and MLP use the fused kernels, and
    unless CUDA graphs are disabled every head pass shape is captured now (one graph per
    batch bucket and tokens per request)."""
    cfg = target.config
    device = target.kv.pool.device
    # Under tensor parallelism the head is whole on every rank, or sharded as the target is
    # (--speculative-head-parallel); either way every rank drafts the same tokens.
    tp = SINGLE_RANK
    if cfg.speculative.head_parallel == "sharded":
        tp = getattr(target.runner.model, "tp", SINGLE_RANK)
    if cfg.speculative.draft_model_path is None:  # --load-format dummy: a random head
        from specserve.model.dummy import build_dummy_eagle3_head

        head = build_dummy_eagle3_head(target.model_config, target.dtype, device, cfg.load.seed, tp)
    else:
        path = cfg.speculative.draft_model_path
        with drafter_errors(path):
            head = load_eagle3_head(path, target.model_config, target.dtype, device, tp)
    head = head.merge_projections()
    kv = KVCache(
        head.kv_config, target.kv.allocator.num_pages, cfg.cache.page_size, target.dtype, device
    )
    embed = target.runner.model.model.embed_tokens
    proposer = Eagle3Proposer(head, embed, kv, target.runner.backend)
    proposer.max_pass_tokens = cfg.scheduler.max_num_batched_tokens
    if device.type == "cuda" and cfg.backend_name() == "triton":
        from specserve.layers.triton_ops import use_triton_ops
        from specserve.tuning.gemv_select import use_gemv

        use_triton_ops(head, fuse=not cfg.execution.disable_fusion)
        # The head's MLP output is never handed on unreduced (plain passes add it; the chain
        # passes' final norm with residual takes a tensor): selection times the down
        # projection with the SiLU prologue only.
        head.midlayer.mlp.fuse_split_k = False
        if not cfg.execution.disable_gemv:
            use_gemv(head, target.gemv_selector)
    if device.type == "cuda":  # eager catch-ups of any length never wait for a compiler
        proposer.backend.warm_up(head.midlayer.self_attn.num_heads, kv.layers[0])
    if device.type == "cuda" and not cfg.execution.disable_cuda_graph:
        proposer.graphs = capture_drafter_graphs(proposer, target)
    return proposer
