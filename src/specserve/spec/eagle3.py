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

from typing import TYPE_CHECKING

import torch

from specserve.engine.kv_cache import KVCache
from specserve.engine.scheduler import ScheduledRequest
from specserve.layers.attention import AttentionBackend
from specserve.model.eagle3 import Eagle3Head, load_eagle3_head
from specserve.runtime.packing import Segment, pack, to_device
from specserve.spec.proposer import Proposer, chain_draft

if TYPE_CHECKING:
    from specserve.engine.engine import LLMEngine

CATCH_UP_STEPS = 128


class Eagle3Proposer(Proposer):
    """Chain drafting with an EAGLE-3 head (one token per draft step)."""

    def __init__(self, head: Eagle3Head, embed: torch.nn.Embedding, kv: KVCache, backend):
        self.head, self.embed, self.kv = head, embed, kv
        self.backend: AttentionBackend = backend
        self.aux_layer_ids = head.aux_layer_ids
        self.target_vocab = head.config.vocab_size
        self.draft_ids = head.draft_to_target(torch.arange(head.config.draft_vocab_size,
                                                           device=head.d2t.device))

    def _target_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Head outputs -> logits over the target vocabulary (-inf outside the draft one)."""
        draft = self.head.compute_logits(out)
        full = torch.full((out.shape[0], self.target_vocab), float("-inf"), device=out.device)
        full[:, self.draft_ids] = draft
        return full

    def _run(self, segments, embeds, hidden):
        _, meta, last_rows = pack(segments, self.kv.page_size, self.kv.pool.device)
        out = self.head(embeds, hidden, meta, self.kv.layers[0], self.backend)
        return out[to_device(last_rows, out.device)]

    @torch.inference_mode()
    def propose(self, items: list[ScheduledRequest]) -> None:
        segments, tokens, feats = [], [], []
        for it in items:
            req = it.request
            start = req.draft_cached_len
            pair_tokens = req.all_token_ids[start + 1 : req.committed_len]
            segments.append(Segment(req.page_table, start, pair_tokens))
            tokens += pair_tokens
            feats += req.draft_features
            req.draft_features.clear()
            req.draft_cached_len = req.committed_len - 1
        device = self.kv.pool.device
        embeds = self.embed(to_device(tokens, device))
        hidden = torch.cat(feats).to(embeds.dtype)
        if hidden.shape[0] != embeds.shape[0]:
            raise RuntimeError("EAGLE-3 features and committed tokens are out of step")
        last = self._run(segments, embeds, hidden)
        drafting = [i for i, it in enumerate(items) if it.draft_len > 0]
        if not drafting:
            return  # a catch-up pass only
        state = {"last": last[to_device(drafting, device)]}

        def step(active, tokens, positions, index):
            # Draft j sits at position committed_len - 2 + j, fed with the head's own output.
            segs = [Segment(it.request.page_table, pos, [0]) for it, pos in zip(active, positions)]
            state["last"] = self._run(segs, self.embed(tokens), state["last"][index])
            return self._target_logits(state["last"])

        chain_draft([items[i] for i in drafting], self._target_logits(state["last"]), step)

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
            embeds = self.embed(torch.zeros(n, dtype=torch.long, device=device))
            hidden = torch.zeros_like(embeds)
            with torch.inference_mode():
                self._target_logits(self._run(segments, embeds, hidden)).argmax(-1).tolist()

        return run


def build_eagle3_proposer(engine: LLMEngine) -> Eagle3Proposer:
    cfg = engine.config
    device = engine.kv.pool.device
    head = load_eagle3_head(
        cfg.speculative_draft_model_path, engine.model_config, engine.dtype, device
    )
    kv = KVCache(head.config.layer, engine.kv.allocator.num_pages, cfg.page_size,
                 engine.dtype, device)
    embed = engine.runner.model.model.embed_tokens
    return Eagle3Proposer(head, embed, kv, engine.runner.backend)
