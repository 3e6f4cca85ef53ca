"""A smaller causal LM with the target's tokenizer drafts tokens, with its own KV pool
indexed by the request's page table."""

from __future__ import annotations

import torch

from specserve.core.batch import ScheduledRequest
from specserve.core.errors import UnsupportedModelError
from specserve.core.kv_cache import KVCache
from specserve.layers.attention import AttentionBackend
from specserve.model.llama import LlamaForCausalLM
from specserve.runtime.model_runner import dummy_forward
from specserve.runtime.packing import Segment, pack, to_device
from specserve.speculative.proposer import Proposer, bounded_passes, chain_draft


class DraftModelProposer(Proposer):
    """Catch-up then chain drafting.

    Each proposing step first runs the draft model over every committed token it has not
    seen (one batched extend; after a stretch without speculation this is the catch-up
    pass), whose last logits give draft 1; then one single-token step per further draft.
    After verification, drafts that were accepted stay valid in the draft KV.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KVCache,
        backend: AttentionBackend,
        target_vocab: int,
    ):
        if model.config.vocab_size != target_vocab:
            raise UnsupportedModelError(
                f"the draft model's vocabulary size ({model.config.vocab_size}) differs from "
                f"the target's ({target_vocab}): a draft model must share the target's "
                "tokenizer and embedding size (a draft whose embedding is padded otherwise is "
                "not supported yet)"
            )
        self.model, self.kv, self.backend = model, kv, backend

    @torch.inference_mode()
    def propose(self, items: list[ScheduledRequest]) -> None:
        self._bound_catch_up(items)
        segments = []
        for it in items:
            req = it.request
            start = req.draft_cached_len
            segments.append(Segment(req.page_table, start, req.token_ids(start, req.committed_len)))
            req.draft_cached_len = req.committed_len
        first = self._forward(segments)

        def step(active, tokens, positions, index):
            # Draft j is token committed_len + j - 1: one position past the chain's `pos`.
            segs = [Segment(it.request.page_table, p + 1, [0]) for it, p in zip(active, positions)]
            return self._forward(segs, tokens)

        chain_draft(items, first, step)

    def _bound_catch_up(self, items: list[ScheduledRequest]) -> None:
        """When the step's catch-up would pass `max_pass_tokens`, every committed token
        before each request's last one runs first, in bounded passes; the step's own
        extend then feeds one token per request."""
        pending = sum(it.request.committed_len - it.request.draft_cached_len for it in items)
        if pending <= self.max_pass_tokens:
            return
        segments = []
        for it in items:
            req = it.request
            start, end = req.draft_cached_len, req.committed_len - 1
            if end > start:
                segments.append(Segment(req.page_table, start, req.token_ids(start, end)))
                req.draft_cached_len = end
        for group in bounded_passes(segments, self.max_pass_tokens):
            packed_ids, meta, _ = pack(group, self.kv.page_size, self.kv.pool.device)
            self.count_eager(len(packed_ids))
            self.model(packed_ids, meta, self.kv.layers, self.backend)

    def _forward(self, segments: list[Segment], input_ids=None) -> torch.Tensor:
        packed_ids, meta, last_rows = pack(segments, self.kv.page_size, self.kv.pool.device)
        input_ids = packed_ids if input_ids is None else input_ids
        self.count_eager(len(input_ids))
        hidden, _ = self.model(input_ids, meta, self.kv.layers, self.backend)
        return self.model.compute_logits(hidden[to_device(last_rows, hidden.device)])

    def step_timer(self):
        return lambda n: dummy_forward(self.model, self.kv, self.backend, n)

    def commit(self, items, accepted, aux, first_rows) -> None:
        for it, a in zip(items, accepted):
            if it.drafts:
                # Drafts 1..k-1 were fed back into the draft KV; accepted ones stay valid.
                it.request.draft_cached_len += min(a, len(it.drafts) - 1)
