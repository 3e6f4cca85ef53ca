"""Tensors in, tokens out: packs a step once, runs the target, samples or verifies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.kv_cache import KVCache
from specserve.engine.scheduler import ScheduledRequest
from specserve.layers.attention import AttentionBackend, AttentionMetadata
from specserve.layers.sampler import build_sampling_tensors, sample
from specserve.model.llama import LlamaForCausalLM
from specserve.runtime.cuda_graphs import CudaGraphRunner
from specserve.runtime.packing import Segment, pack, to_device
from specserve.spec.verify import verify


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
    first_rows: list[int]  # first packed row of each scheduled request
    sampled: list[ScheduledRequest]  # requests that draw tokens this step
    sample_rows: list[int]  # their logit rows: last committed token, then each draft


@dataclass
class StepResult:
    """Per sampled request: new tokens (accepted drafts + one drawn), their logprobs."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]


class ModelRunner:
    """Owns the target model, its KV cache and the attention backend."""

    def __init__(self, model: LlamaForCausalLM, kv: KVCache, backend: AttentionBackend):
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = kv.pool.device
        self.graphs: CudaGraphRunner | None = None  # set by the engine on CUDA

    def prepare(self, batch: list[ScheduledRequest]) -> StepInput:
        segments = []
        for s in batch:
            req, start = s.request, s.request.cached_len
            ids = req.all_token_ids[start : start + s.num_tokens] + s.drafts
            segments.append(Segment(req.page_table, start, ids))
        if self.graphs is not None and all(s.decoding for s in batch):
            # Decode/verify steps with mixed draft lengths: pad to one length per request.
            width = max(len(seg.token_ids) for seg in segments)
            for seg in segments:
                seg.pad = width - len(seg.token_ids)
        input_ids, meta, last_rows = pack(segments, self.kv.page_size, self.device)
        first_rows = [last - len(seg.token_ids) + 1 for last, seg in zip(last_rows, segments)]
        sampled, sample_rows = [], []
        for s, last in zip(batch, last_rows):
            if s.samples:
                sampled.append(s)
                sample_rows += range(last - len(s.drafts), last + 1)
        return StepInput(input_ids, meta, first_rows, sampled, sample_rows)

    @torch.inference_mode()
    def forward(self, step: StepInput, aux_layer_ids: tuple[int, ...] = ()):
        """Hidden states of every packed token, and the requested auxiliary ones; through a
        captured CUDA graph when the step has one (uniform tokens per request)."""
        graphs = self.graphs
        if graphs is not None and graphs.can_run(step.meta, step.input_ids.shape[0]):
            return graphs.run(step.input_ids, step.meta)
        return self.model(step.input_ids, step.meta, self.kv.layers, self.backend, aux_layer_ids)

    @torch.inference_mode()
    def time_forward(self, num_tokens: int) -> None:
        """A synchronized decode-shaped step of `num_tokens` tokens on the scratch page (for
        the cost model): one token per request, or several per request beyond the largest
        graph batch, so that the step runs the way a real one of that size would."""
        max_batch = self.graphs.batch_buckets[-1] if self.graphs is not None else num_tokens
        per_request = -(-num_tokens // max_batch)
        table = [0] * -(-per_request // self.kv.page_size)
        segments = [Segment(table, 0, [0] * per_request) for _ in range(num_tokens // per_request)]
        input_ids, meta, last_rows = pack(segments, self.kv.page_size, self.device)
        step = StepInput(input_ids, meta, [], [], [])
        hidden, _ = self.forward(step)
        rows = to_device(last_rows, self.device)
        self.model.compute_logits(hidden[rows]).argmax(dim=-1).tolist()

    @torch.inference_mode()
    def sample(
        self, step: StepInput, hidden: torch.Tensor, simulate_rate: float | None = None
    ) -> StepResult:
        """Draw each sampled request's tokens: plainly, or by verifying its drafts."""
        if not step.sampled:
            return StepResult([], [])
        reqs = [s.request for s in step.sampled]
        logits = self.model.compute_logits(hidden[to_device(step.sample_rows, self.device)])
        st = build_sampling_tensors(
            [r.params for r in reqs],
            [r.seed for r in reqs],
            [r.committed_len for r in reqs],
            self.device,
        )
        k_max = max(len(s.drafts) for s in step.sampled)
        if k_max == 0:
            tokens = sample(logits, st)
            rows = [[t] for t in tokens.tolist()]
            if all(r.params.logprobs is None for r in reqs):
                return StepResult(rows, [None] * len(reqs))
            return StepResult(rows, self._logprobs(logits, tokens, reqs, rows))
        result = self._verify(step.sampled, logits, st, k_max, simulate_rate)
        accept = result.accept_len.tolist()
        all_tokens = result.tokens.tolist()
        rows = [t[: a + 1] for t, a in zip(all_tokens, accept)]
        if all(r.params.logprobs is None for r in reqs):
            return StepResult(rows, [None] * len(reqs))
        # Logprobs of the committed tokens only: rows 0..a of each request.
        offsets, picked = 0, []
        for s, a in zip(step.sampled, accept):
            picked += range(offsets, offsets + a + 1)
            offsets += len(s.drafts) + 1
        flat = torch.tensor([t for r in rows for t in r], device=self.device)
        lp = self._logprobs(logits[to_device(picked, self.device)], flat, reqs, rows)
        return StepResult(rows, lp)

    def _verify(self, sampled, logits, st, k_max, simulate_rate):
        num = len(sampled)
        vocab = logits.shape[-1]
        index, drafts, lens = [], [], []
        offset = 0
        for s in sampled:
            k = len(s.drafts)
            index += [offset + min(j, k) for j in range(k_max + 1)]
            drafts += s.drafts + [0] * (k_max - k)
            lens.append(k)
            offset += k + 1
        padded = logits[to_device(index, self.device)].view(num, k_max + 1, vocab)
        draft_t = to_device(drafts, self.device).view(num, k_max)
        lens_t = to_device(lens, self.device)
        probs = None
        if any(s.draft_probs is not None for s in sampled):
            probs = torch.zeros(num, k_max, vocab, device=self.device)
            for i, s in enumerate(sampled):
                k = len(s.drafts)
                if s.draft_probs is not None:
                    probs[i, :k] = s.draft_probs[:k]
                elif k:
                    probs[i, torch.arange(k), draft_t[i, :k]] = 1.0
        return verify(padded, draft_t, lens_t, st, probs, simulate_rate)

    def _logprobs(self, logits, tokens, reqs, rows):
        """Split flat per-token logprobs (one logits row per committed token) by request."""
        wanted = [r.params.logprobs for r, row in zip(reqs, rows) for _ in row]
        flat = token_logprobs(logits, tokens, wanted)
        out, i = [], 0
        for r, row in zip(reqs, rows):
            out.append(None if r.params.logprobs is None else flat[i : i + len(row)])
            i += len(row)
        return out


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


@torch.inference_mode()
def dummy_forward(model, kv: KVCache, backend: AttentionBackend, num_tokens: int) -> None:
    """A decode-shaped forward of `num_tokens` one-token requests writing only to the
    scratch page 0; synchronizes (used to time steps for the cost model)."""
    segments = [Segment([0], 0, [0]) for _ in range(num_tokens)]
    input_ids, meta, last_rows = pack(segments, kv.page_size, kv.pool.device)
    hidden, _ = model(input_ids, meta, kv.layers, backend)
    model.compute_logits(hidden[to_device(last_rows, hidden.device)]).argmax(dim=-1).tolist()
