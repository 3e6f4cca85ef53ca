"""Tensors in, tokens out: builds a step's tensors once, runs the model, samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.kv_cache import KVCache
from specserve.engine.scheduler import ScheduledRequest
from specserve.layers.attention import AttentionBackend, AttentionMetadata
from specserve.layers.sampler import build_sampling_tensors, sample
from specserve.model.llama import LlamaForCausalLM


@dataclass
class TokenLogprobs:
    """The chosen token's log-probability and the top alternatives as (id, logprob)."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class StepInput:
    """Everything the forward pass of one step reads, on the device."""

    input_ids: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_idx: torch.Tensor  # [S] rows of the packed tokens whose logits are sampled
    sampled_requests: list  # the S requests that get a token this step


class ModelRunner:
    """Owns the model, its KV cache and the attention backend."""

    def __init__(self, model: LlamaForCausalLM, kv: KVCache, backend: AttentionBackend):
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = kv.pool.device
        self.pin = self.device.type == "cuda"

    def _to_device(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.int64)
        if self.pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def prepare(self, batch: list[ScheduledRequest]) -> StepInput:
        page_size = self.kv.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        sample_idx: list[int] = []
        sampled = []
        max_pages = max(len(s.request.page_table) for s in batch)
        tables: list[int] = []
        for s in batch:
            req, start = s.request, s.request.cached_len
            end = start + s.num_tokens
            input_ids += req.all_token_ids[start:end]
            table = req.page_table
            for pos in range(start, end):
                positions.append(pos)
                slots.append(table[pos // page_size] * page_size + pos % page_size)
            starts.append(starts[-1] + s.num_tokens)
            seq_lens.append(end)
            tables += table + [0] * (max_pages - len(table))
            if s.samples:
                sample_idx.append(starts[-1] - 1)
                sampled.append(req)
        meta = AttentionMetadata(
            positions=self._to_device(positions),
            slot_mapping=self._to_device(slots),
            query_start_loc=self._to_device(starts),
            seq_lens=self._to_device(seq_lens),
            block_tables=self._to_device(tables).view(len(batch), max_pages),
            max_query_len=max(s.num_tokens for s in batch),
            max_seq_len=max(seq_lens),
        )
        return StepInput(self._to_device(input_ids), meta, self._to_device(sample_idx), sampled)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Run the step; return one sampled token per request in `step.sampled_requests`,
        and its logprobs where the request asked for them."""
        hidden, _ = self.model(step.input_ids, step.meta, self.kv.layers, self.backend)
        reqs = step.sampled_requests
        if not reqs:
            return [], []
        logits = self.model.compute_logits(hidden[step.sample_idx])
        st = build_sampling_tensors(
            [r.params for r in reqs],
            [r.seed for r in reqs],
            [r.committed_len for r in reqs],
            self.device,
        )
        tokens = sample(logits, st)
        wanted = [r.params.logprobs for r in reqs]
        if all(w is None for w in wanted):
            return tokens.tolist(), [None] * len(reqs)
        return tokens.tolist(), token_logprobs(logits, tokens, wanted)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None]
) -> list[TokenLogprobs | None]:
    """Log-probabilities under the model's raw distribution (before temperature and
    filters): the chosen token's and the top-k alternatives'."""
    logp = logits.log_softmax(dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()
    k = max(w or 0 for w in wanted)
    top_lp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    out: list[TokenLogprobs | None] = []
    for i, w in enumerate(wanted):
        if w is None:
            out.append(None)
        else:
            out.append(TokenLogprobs(chosen[i], list(zip(top_ids[i][:w], top_lp[i][:w]))))
    return out
