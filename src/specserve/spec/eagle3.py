"""EAGLE-3 drafting: the head reads the target's low/mid/high features and its own outputs.

Head position i holds the pair (target feature of token i, embedding of token i+1) and
predicts token i+2. After each target pass the features of newly committed positions are
projected by the head's fc and queued on the request (`draft_features`); the next proposing
step first runs the head over the queued pairs (the catch-up: one batched extend over
everything committed since it last drafted, however long the request went without
speculating), whose last output yields draft 1; each further draft feeds the head's own
output and the previous draft back in. The head's KV lives in the request's pages.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from specserve.engine.kv_cache import KVCache
from specserve.engine.scheduler import ScheduledRequest
from specserve.layers.attention import AttentionBackend
from specserve.model.eagle3 import Eagle3Head, load_eagle3_head
from specserve.runtime.packing import Segment, pack, to_device
from specserve.spec.eagle3_graphs import DrafterGraphs
from specserve.spec.proposer import Proposer, chain_draft, draw_drafts

if TYPE_CHECKING:
    from specserve.engine.engine import LLMEngine

CATCH_UP_STEPS = 128
log = logging.getLogger("specserve")


class Eagle3Proposer(Proposer):
    """Chain drafting with an EAGLE-3 head (one token per draft step).

    `graphs` (DrafterGraphs, set on CUDA) runs every head pass that has a captured shape;
    greedy drafts are the argmax over the draft vocabulary mapped through d2t, so only
    sampled requests pay for logits over the whole target vocabulary."""

    def __init__(self, head: Eagle3Head, embed: torch.nn.Embedding, kv: KVCache, backend):
        self.head, self.embed, self.kv = head, embed, kv
        self.backend: AttentionBackend = backend
        self.aux_layer_ids = head.aux_layer_ids
        self.target_vocab = head.config.vocab_size
        self.draft_ids = head.draft_to_target(torch.arange(head.config.draft_vocab_size,
                                                           device=head.d2t.device))
        self.graphs: DrafterGraphs | None = None

    def _target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits -> logits over the target vocabulary (-inf outside)."""
        full = torch.full((draft_logits.shape[0], self.target_vocab), float("-inf"),
                          device=draft_logits.device)  # fmt: skip
        full[:, self.draft_ids] = draft_logits
        return full

    def _draw(self, draft_logits: torch.Tensor, items: list[ScheduledRequest], step: int):
        if all(it.request.params.temperature == 0 for it in items):
            return self.draft_ids[draft_logits.argmax(dim=-1)], None
        return draw_drafts(self._target_logits(draft_logits), items, step)

    def _pass(self, segments: list[Segment], hidden: torch.Tensor, input_ids=None):
        """One head pass: (output at each segment's last token, its draft logits)."""
        if self.graphs is not None and self.graphs.can_run(segments):
            return self.graphs.run(segments, hidden, input_ids)
        ids, meta, last_rows = pack(segments, self.kv.page_size, self.kv.pool.device)
        embeds = self.embed(ids if input_ids is None else input_ids)
        out = self.head(embeds, hidden, meta, self.kv.layers[0], self.backend)
        last = out[to_device(last_rows, out.device)]
        return last, self.head.compute_logits(last)

    @torch.inference_mode()
    def propose(self, items: list[ScheduledRequest]) -> None:
        segments, feats, num_tokens = [], [], 0
        for it in items:
            req = it.request
            start = req.draft_cached_len
            pair_tokens = req.token_ids(start + 1, req.committed_len)
            segments.append(Segment(req.page_table, start, pair_tokens))
            num_tokens += len(pair_tokens)
            feats += req.draft_features
            req.draft_features.clear()
            req.draft_cached_len = req.committed_len - 1
        hidden = torch.cat(feats).to(self.head.fc.weight.dtype)
        if hidden.shape[0] != num_tokens:
            raise RuntimeError("EAGLE-3 features and committed tokens are out of step")
        k = items[0].draft_len
        if (
            self.graphs is not None
            and all(it.draft_len == k and it.request.params.temperature == 0 for it in items)
            and self.graphs.can_run_chain(segments, k)
        ):  # the whole greedy step in one graph
            for it, drafts in zip(items, self.graphs.run_chain(segments, hidden, k).tolist()):
                it.drafts.extend(drafts)
            return
        last, logits = self._pass(segments, hidden)
        drafting = [i for i, it in enumerate(items) if it.draft_len > 0]
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

    def wants_catch_up(self, req) -> bool:
        """Bound the features queued while a request does not speculate: after
        CATCH_UP_STEPS steps' worth the head consumes them in this step (ride-along)."""
        return len(req.draft_features) >= CATCH_UP_STEPS

    def commit(self, items, accepted, aux, first_rows) -> None:
        """Queue the projected features of every newly committed position."""
        if aux is None:
            return
        with torch.inference_mode():
            projected = self.head.project(aux.to(self.head.fc.weight.dtype))
        for it, a, first in zip(items, accepted, first_rows):
            # A view into this step's projection: no copy per request.
            it.request.draft_features.append(projected[first : first + it.num_tokens + a])

    def step_timer(self):
        def run(n: int) -> None:
            device = self.kv.pool.device
            segments = [Segment([0], 0, [0]) for _ in range(n)]
            hidden = torch.zeros(n, self.head.config.layer.hidden_size,
                                 dtype=self.head.fc.weight.dtype, device=device)  # fmt: skip
            with torch.inference_mode():
                _, logits = self._pass(segments, hidden)
                self.draft_ids[logits.argmax(dim=-1)].tolist()

        return run


def build_eagle3_proposer(engine: LLMEngine) -> Eagle3Proposer:
    """The head loaded for the engine's target; on CUDA with the Triton backend its norms,
    rotary and MLP use the fused kernels, and unless CUDA graphs are disabled every head
    pass shape is captured now (one graph per batch bucket and tokens per request)."""
    cfg = engine.config
    device = engine.kv.pool.device
    head = load_eagle3_head(
        cfg.speculative_draft_model_path, engine.model_config, engine.dtype, device
    )
    kv = KVCache(head.config.layer, engine.kv.allocator.num_pages, cfg.page_size,
                 engine.dtype, device)
    embed = engine.runner.model.model.embed_tokens
    proposer = Eagle3Proposer(head, embed, kv, engine.runner.backend)
    if device.type == "cuda" and cfg.backend_name() == "triton":
        from specserve.layers.triton_ops import use_triton_ops

        use_triton_ops(head)
    if device.type == "cuda":  # eager catch-ups of any length never wait for a compiler
        proposer.backend.warm_up(head.config.layer.num_heads, kv.layers[0])
    if device.type == "cuda" and not cfg.disable_cuda_graph:
        proposer.graphs = capture_drafter_graphs(proposer, engine)
    return proposer


def catch_up_lengths(k_max: int) -> tuple[int, ...]:
    """Tokens per request of the captured head passes: 1 (draft steps), up to K+1 (the
    catch-up after a verify step) and 2(K+1) (after a verify step and a plain step, as
    draft lengths switching between 0 and K leave it); longer catch-ups run eagerly."""
    return (*range(1, k_max + 2), 2 * (k_max + 1))


def capture_drafter_graphs(
    proposer: Eagle3Proposer, engine: LLMEngine, use_graphs: bool = True
) -> DrafterGraphs:
    """Graphs for draft steps and catch-ups (`catch_up_lengths`); use_graphs=False: the
    same padded path, eager."""
    from specserve.runtime.cuda_graphs import default_batch_buckets

    cfg = engine.config
    graphs = DrafterGraphs(
        proposer.head, proposer.embed, proposer.kv.layers[0], proposer.backend,
        default_batch_buckets(min(cfg.max_num_seqs, cfg.cuda_graph_max_batch)),
        catch_up_lengths(cfg.speculative_num_steps), engine.max_model_len, use_graphs,
        chain_lengths=tuple(range(2, cfg.speculative_num_steps + 1)),  # every K >= 2
    )  # fmt: skip
    report = graphs.capture()
    log.info(
        "captured %d EAGLE-3 drafter CUDA graphs in %.1f s (warm-up %.1f s), graph memory "
        "%.1f MiB, static buffers %.1f MiB", report.num_graphs, report.capture_s,
        report.warmup_s, report.graph_pool_bytes / 2**20, report.static_bytes / 2**20,
    )  # fmt: skip
    return graphs
