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
        self.model, self.kv, self.backend = model, kv, backend
        # A draft sharing the target's tokenizer may pad its embedding to another size
        # (Qwen2.5-0.5B's 151,936 rows against 7B's 152,064): its logits are cut or padded
        # to the target's ids (padding never drafted), and an id past its rows (one the
        # tokenizer never makes, which a target may still sample) is fed to it as id 0:
        # its drafts after that are only worse, and every draft is verified.
        self.vocab, self.target_vocab = model.config.vocab_size, target_vocab

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
            self.model(self._own_ids(packed_ids), meta, self.kv.layers, self.backend)

    def _forward(self, segments: list[Segment], input_ids=None) -> torch.Tensor:
        packed_ids, meta, last_rows = pack(segments, self.kv.page_size, self.kv.pool.device)
        input_ids = self._own_ids(packed_ids) if input_ids is None else input_ids
        self.count_eager(len(input_ids))
        hidden, _ = self.model(input_ids, meta, self.kv.layers, self.backend)
        logits = self.model.compute_logits(hidden[to_device(last_rows, hidden.device)])
        return fit_vocab(logits, self.target_vocab)

    def _own_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids as the draft's embedding takes them (see __init__)."""
        if self.vocab >= self.target_vocab:
            return ids
        return torch.where(ids < self.vocab, ids, torch.zeros_like(ids))

    def step_timer(self):
        return lambda n: dummy_forward(self.model, self.kv, self.backend, n)

    def commit(self, items, accepted, aux, first_rows) -> None:
        for it, a in zip(items, accepted):
            if it.drafts:
                # Drafts 1..k-1 were fed back into the draft KV; accepted ones stay valid.
                it.request.draft_cached_len += min(a, len(it.drafts) - 1)


def fit_vocab(logits: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """Draft logits [R, V_draft] over the target's ids [R, target_vocab]: a padded draft
    embedding's extra columns cut, a smaller one's missing ids at -inf (never drafted, zero
    probability for rejection sampling)."""
    vocab = logits.shape[-1]
    if vocab == target_vocab:
        return logits
    if vocab > target_vocab:
        return logits[:, :target_vocab]
    return torch.nn.functional.pad(logits, (0, target_vocab - vocab), value=float("-inf"))


def check_tokenizers(draft_tokenizer, target_tokenizer, draft_vocab: int, target_vocab: int):
    """Refuse a draft model whose tokens mean other text than the target's: its drafts
    would all be rejected (the output stays the target's, at a loss). The ordinary tokens
    must be the same; added and special tokens may differ (Llama 3.1 renamed 3.0's reserved
    ones, DeepSeek's Qwen distills Qwen's): a draft of one the target reads otherwise is
    rejected, as any wrong draft. `draft_tokenizer` None (its folder has none specserve can
    read): only an embedding of the target's size is taken on trust."""
    if draft_tokenizer is None:
        if draft_vocab != target_vocab:
            raise UnsupportedModelError(
                f"the draft model's vocabulary size ({draft_vocab}) differs from the "
                f"target's ({target_vocab}) and its folder has no tokenizer to show that the "
                "two share one: add the draft's tokenizer files (tokenizer.json, "
                "tokenizer_config.json)"
            )
        return
    if target_tokenizer is None:
        return
    draft, target = _ordinary_tokens(draft_tokenizer), _ordinary_tokens(target_tokenizer)
    if draft == target:
        return
    differ = sorted(t for t in draft.keys() | target.keys() if draft.get(t) != target.get(t))
    example = differ[0]
    raise UnsupportedModelError(
        f"the draft model's tokenizer differs from the target's ({len(differ)} of "
        f"{len(target)} ordinary tokens: e.g. {example!r} is id {draft.get(example)} to the "
        f"draft, {target.get(example)} to the target): a draft model must share the target's "
        "tokenizer (its drafts are token ids)"
    )


def _ordinary_tokens(tokenizer) -> dict[str, int]:
    """The tokenizer's vocabulary without its added (special) tokens."""
    added = tokenizer.get_added_vocab()
    return {t: i for t, i in tokenizer.get_vocab().items() if t not in added}
