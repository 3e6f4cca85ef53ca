"""Tensors in, tokens out: packs a step once, runs the target, samples or verifies."""

from __future__ import annotations

import torch

from specserve.core.batch import ScheduledRequest
from specserve.core.kv_cache import KVCache
from specserve.layers.attention import AttentionBackend
from specserve.layers.sampler import SamplingTensors, argmax_rows, sample
from specserve.model.llama import LlamaForCausalLM
from specserve.runtime.cuda_graphs import CudaGraphRunner
from specserve.runtime.grammar import GrammarCompiler, copy_drafts, start_masks
from specserve.runtime.inflight import InflightStep, place_device_tokens
from specserve.runtime.logit_shaping import shape_logits
from specserve.runtime.packing import Segment, pack, to_device, upload
from specserve.runtime.sampled_tokens import (
    SampledTokens,
    StepResult,
    TokenLogprobs,
    logprob_tensors,
)
from specserve.runtime.step_input import SamplePlan, StepInput
from specserve.runtime.verify import VerifyResult, verify, verify_greedy

__all__ = ["InflightStep", "ModelRunner", "StepInput", "StepResult", "TokenLogprobs"]


class ModelRunner:
    """Owns the target model, its KV cache and the attention backend."""

    def __init__(self, model: LlamaForCausalLM, kv: KVCache, backend: AttentionBackend):
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = kv.pool.device
        self.graphs: CudaGraphRunner | None = None  # set by the engine on CUDA
        self.grammars: GrammarCompiler | None = None  # structured output (set by the engine)
        # (hidden, logits, greedy tokens[, greedy accept lengths]) of the last forward,
        # where its graph took them (CudaGraphRunner.last_head)
        self.step_head: tuple[torch.Tensor, ...] | None = None

    def prepare(
        self,
        batch: list[ScheduledRequest],
        prev: InflightStep | None = None,
        constrained: bool = False,
    ) -> StepInput:
        """Pack the step. With `prev`, the step in flight: a request of it has its last
        committed token on the device (gathered from prev's drawn tokens) and, when prev
        drafted, sits further right by prev's accept length than the host knows (packed as
        if nothing was accepted, shifted on the device). Drafts the proposer left on the
        device (`device_drafts`) are placed on the device too. `constrained`: a request of
        the batch may follow a grammar (its drafts start their copy to the host now,
        runtime/grammar.py: copy_drafts). Nothing here waits."""
        segments, prev_rows, missing = [], [], []
        moved = prev is not None and prev.speculative
        for i, s in enumerate(batch):
            req, start = s.request, s.request.cached_len
            ids = req.token_ids(start, start + s.num_tokens)
            row = prev.rows.get(id(req), -1) if prev is not None else -1
            if len(ids) < s.num_tokens:  # only the in-flight step's one token is missing
                if row < 0 or len(ids) + 1 != s.num_tokens:
                    raise RuntimeError("a step's input token is neither on the host nor in flight")
                missing.append(i)
                ids = ids + [0]
            drafts = s.drafts if s.device_drafts is None else [0] * s.draft_len
            shift = prev.drafted[row] if moved and row >= 0 else 0
            segments.append(Segment(req.page_table, start, ids + drafts, max_shift=shift))
            prev_rows.append(row)
        if self.graphs is not None and all(s.decoding for s in batch):
            # Decode/verify steps with mixed draft lengths: pad to one length per request.
            max_q_len = max(len(seg.token_ids) for seg in segments)
            for seg in segments:
                seg.pad = max_q_len - len(seg.token_ids)
        sampled = [i for i, s in enumerate(batch) if s.samples]
        shift = sample_shift = None
        if moved:
            shift = prev.accepted(prev_rows)
            sample_shift = (
                shift
                if len(sampled) == len(batch)
                else prev.accepted([prev_rows[i] for i in sampled])
            )
        input_ids, meta, last_rows = pack(segments, self.kv.page_size, self.device, shift)
        meta.prefill = not all(s.decoding for s in batch)
        place_device_tokens(batch, input_ids, last_rows, missing, prev_rows, prev, self.device)
        first_rows = [last - len(seg.token_ids) + 1 for last, seg in zip(last_rows, segments)]
        sample_rows = []
        for i in sampled:
            last = last_rows[i]
            sample_rows += range(last - batch[i].drafted, last + 1)
        step = StepInput(
            input_ids, meta, first_rows, [batch[i] for i in sampled], sample_rows, sample_shift
        )
        if constrained:
            step.grammar_drafts = copy_drafts(step)
        return step

    @torch.inference_mode()
    def forward(self, step: StepInput, aux_layer_ids: tuple[int, ...] = ()):
        """Hidden states of every packed token, and the requested auxiliary ones; through a
        captured CUDA graph when the step has one (uniform tokens per request, or a mixed
        step within the mixed graphs' buckets), whose replay already gave the aux to the
        drafter's feature writer (none returned)."""
        graphs = self.graphs
        self.step_head = None
        num_tokens = step.input_ids.shape[0]
        if graphs is not None and graphs.can_run(step.meta, num_tokens):
            hidden, aux = graphs.run(step.input_ids, step.meta)
            if graphs.last_head is not None:
                self.step_head = (hidden, *graphs.last_head)
            return hidden, aux
        if graphs is not None and graphs.can_run_mixed(step.meta, num_tokens):
            return graphs.run_mixed(step.input_ids, step.meta)
        return self.model(step.input_ids, step.meta, self.kv.layers, self.backend, aux_layer_ids)

    def _logits(self, hidden: torch.Tensor, rows, fp32: bool) -> torch.Tensor:
        """Logits of `hidden`'s rows (`rows`: a device index, or None for every row): the
        ones the step's CUDA graph already computed for these hidden states when it did
        (`step_head`), else projected now."""
        head = self.step_head
        if head is not None and head[0] is hidden:
            logits = head[1] if rows is None else head[1][rows]
            return logits.float() if fp32 else logits
        return self.model.compute_logits(hidden if rows is None else hidden[rows], fp32)

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
        if self.step_head is not None:  # the graph took the greedy tokens, as in a step
            self.step_head[2][rows].tolist()
        else:
            argmax_rows(self.model.compute_logits(hidden[rows], fp32=False)).tolist()

    def start_masks(self, step: StepInput) -> bool:
        """Hand the step's grammar masks to the grammar workers now, where they fill them
        (runtime/grammar.py: start_masks; needs the step in flight's tokens): True when
        sent, and `sample_async` collects them."""
        return self.grammars is not None and start_masks(step, self.grammars)

    @torch.inference_mode()
    def sample_async(
        self, step: StepInput, hidden: torch.Tensor, simulate_rate: float | None = None
    ) -> SampledTokens:
        """Draw each sampled request's tokens (plainly, or by verifying its drafts) and start
        copying them to the host; nothing here waits for the device. The step's host data
        (logit rows, draft rows, draft lengths, sampling parameters) goes to the device in
        one pinned copy of integers and, when a request samples, one of floats; the drafts
        themselves are read from the step's input ids (wherever the proposer left them)."""
        if not step.sampled:
            empty = torch.zeros(0, 1, dtype=torch.int64, device=self.device)
            return SampledTokens(empty, None, [])
        plan = SamplePlan.of(step, hidden, self.step_head)
        if plan.max_draft_len == 0 and plan.greedy:
            return self._greedy_plain(step, hidden, plan)
        t = self._upload(step, plan, simulate_rate)
        logits = self._logits(hidden, None if plan.all_rows else t["rows"], plan.fp32)
        if plan.shaped:
            logits = shape_logits(logits, step, self.grammars)
        if plan.max_draft_len == 0:  # plain sampling
            tokens = sample(logits, t["sampling"])[:, None]
            return self._with_logprobs(step, logits, tokens, None, plan.want, 0)
        return self._verify(step, plan, t, logits, simulate_rate)

    def _greedy_plain(self, step: StepInput, hidden: torch.Tensor, plan: SamplePlan):
        """Plain greedy decoding: the argmax of each sampled row (the tokens the step's graph
        took already, when it took them for exactly these rows)."""
        head, want = plan.head, plan.want
        if head is not None and plan.all_rows and not plan.fp32:  # tokens the graph took
            return self._with_logprobs(step, head[1], head[2][:, None], None, want, 0)
        rows = None if plan.all_rows else to_device(step.sample_rows, self.device)
        logits = self._logits(hidden, rows, plan.fp32)
        if plan.shaped:
            logits = shape_logits(logits, step, self.grammars)
        tokens = argmax_rows(logits)[:, None]  # the sampler's greedy rows, no tensors
        return self._with_logprobs(step, logits, tokens, None, want, 0)

    def _upload(self, step: StepInput, plan: SamplePlan, simulate_rate: float | None) -> dict:
        """The integers the step's sampling or verification reads, in one copy: the logit
        rows (unless every row), each (request, j < K)'s draft row and, with short drafts,
        each (request, j <= K)'s logit row (unless dense), the draft lengths (unless greedy
        and uniform), seeds and positions (seeded draws: sampling or simulated acceptance),
        top-k; and `sampling`, the sampling tensors (None when greedy)."""
        rows, reqs = step.sample_rows, plan.reqs
        ints = {}
        if not plan.all_rows:
            ints["rows"] = rows
        if plan.max_draft_len and not plan.dense:
            max_draft_len, uniform = plan.max_draft_len, plan.uniform
            index = []  # logit row of each (request, j <= K), repeating the last (short drafts)
            draft_rows, offset = [], 0  # input row of each (request, j < K)
            for draft_len in plan.draft_lens:
                # Short drafts are padded with their last row's token (ignored past the length).
                pad = max_draft_len - draft_len
                draft_rows += (
                    rows[offset + 1 : offset + draft_len + 1] + [rows[offset + draft_len]] * pad
                )
                if not uniform:
                    index += [offset + min(j, draft_len) for j in range(plan.max_q_len)]
                offset += draft_len + 1
            ints["draft_rows"] = draft_rows
            if not uniform:
                ints["index"] = index
        if plan.max_draft_len and not (plan.greedy and plan.uniform):
            ints["draft_lens"] = plan.draft_lens
        if not plan.greedy or simulate_rate is not None:  # counters: seeded draws
            ints["seeds"] = [r.seed for r in reqs]
            ints["positions"] = [r.committed_len for r in reqs]
        if not plan.greedy:
            ints["top_k"] = [r.params.top_k for r in reqs]
        t = dict(zip(ints, upload(list(ints.values()), self.device))) if ints else {}
        if "positions" in t and step.sample_shift is not None:
            t["positions"] = t["positions"] + step.sample_shift  # moved by the step in flight
        t["sampling"] = None
        if not plan.greedy:
            t["sampling"] = _sampling_tensors(
                reqs, t["seeds"], t["positions"], t["top_k"], self.device
            )
        return t

    def _verify(
        self,
        step: StepInput,
        plan: SamplePlan,
        t: dict,
        logits: torch.Tensor,
        simulate_rate: float | None,
    ) -> SampledTokens:
        """Verify every request's drafts against the target's rows: greedily (in the step's
        graph, when it verified them already), against the plain sampler's draws, or by
        rejection sampling (runtime/verify.py)."""
        sampled = step.sampled
        num, max_q_len, vocab = len(sampled), plan.max_q_len, logits.shape[-1]
        padded = (logits if plan.uniform else logits[t["index"]]).view(num, max_q_len, vocab)
        if plan.dense:
            drafts_t = step.input_ids.view(num, max_q_len)[:, 1:]
        else:
            drafts_t = step.input_ids[t["draft_rows"]].view(num, plan.max_draft_len)
        if plan.greedy:
            result = self._verify_greedy(plan, padded, drafts_t, t, simulate_rate)
        else:
            draft_lens = t.get("draft_lens")
            probs = self._draft_probs(sampled, plan.max_draft_len, vocab)
            result = verify(padded, drafts_t, draft_lens, t["sampling"], probs, simulate_rate)
        # Drafts the host has not seen go back with the tokens (statistics only).
        on_device = any(s.device_drafts is not None for s in sampled)
        return self._with_logprobs(
            step,
            logits,
            result.tokens,
            result.accept_len,
            plan.want,
            plan.max_draft_len,
            drafts_t if on_device else None,
        )

    @staticmethod
    def _verify_greedy(plan: SamplePlan, padded, drafts_t, t: dict, simulate_rate):
        """Greedy verification: taken from the step's graph when it verified these rows
        already (a dense step: its greedy tokens are the rows' argmaxes, and every request
        drafts K, q_len = K + 1), else computed (from the graph's argmaxes where it took
        them)."""
        head, num = plan.head, padded.shape[0]
        choice = head[2].view(num, plan.max_q_len) if head is not None and plan.dense else None
        if choice is not None and simulate_rate is None and len(head) > 3:
            # a copy: the next step may read the lengths after its own replay (sample_shift),
            # which overwrites the graph's
            return VerifyResult(choice, head[3].clone())
        return verify_greedy(
            padded,
            drafts_t,
            t.get("draft_lens"),
            t.get("seeds"),
            t.get("positions"),
            simulate_rate,
            choice,
        )

    def _with_logprobs(
        self, step, logits, tokens, accept_len, want, max_draft_len, drafts=None
    ) -> SampledTokens:
        device = self.device
        if all(w is None for w in want):
            return SampledTokens(tokens, accept_len, want, drafts=drafts)
        # Logprobs of every row a request may commit (its drafts' and the bonus'); the
        # host keeps the accepted ones.
        flat, lp_rows, row = [], [], 0
        for r, s in enumerate(step.sampled):
            q_len = s.drafted + 1
            flat += [r * (max_draft_len + 1) + j for j in range(q_len)]
            lp_rows.append(list(range(row, row + q_len)))
            row += q_len
        chosen = tokens.reshape(-1)[to_device(flat, device)]
        lp = logprob_tensors(logits, chosen, max(w or 0 for w in want))
        return SampledTokens(tokens, accept_len, want, lp, lp_rows, drafts)

    def _draft_probs(self, sampled, max_draft_len: int, vocab: int) -> torch.Tensor | None:
        """[R, K, V] the drafter's distributions of the requests verified by rejection
        sampling (zero on the others), or None when there are none."""
        if all(s.draft_probs is None for s in sampled):
            return None
        probs = torch.zeros(len(sampled), max_draft_len, vocab, device=self.device)
        for i, s in enumerate(sampled):
            if s.draft_probs is not None:
                probs[i, : s.drafted] = s.draft_probs[: s.drafted]
        return probs


def _sampling_tensors(reqs, seeds, positions, top_k, device) -> SamplingTensors:
    """`layers.sampler.build_sampling_tensors` with the integer fields already on the device
    (uploaded with the step's other integers) and the float fields in one more copy."""
    params = [r.params for r in reqs]
    temps = [p.temperature for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    floats = to_device(temps + top_p + min_p, device, torch.float32)
    n = len(params)
    on = [t > 0 for t in temps]
    return SamplingTensors(
        temperature=floats[:n],
        top_k=top_k,
        top_p=floats[n : 2 * n],
        min_p=floats[2 * n :],
        seeds=seeds,
        positions=positions,
        all_greedy=not any(on),
        any_top_k_or_p=any(o and (p.top_k > 0 or p.top_p < 1.0) for o, p in zip(on, params)),
        any_min_p=any(o and p.min_p > 0 for o, p in zip(on, params)),
    )


@torch.inference_mode()
def dummy_forward(model, kv: KVCache, backend: AttentionBackend, num_tokens: int) -> None:
    """A decode-shaped forward of `num_tokens` one-token requests writing only to the
    scratch page 0; synchronizes (used to time steps for the cost model)."""
    segments = [Segment([0], 0, [0]) for _ in range(num_tokens)]
    input_ids, meta, last_rows = pack(segments, kv.page_size, kv.pool.device)
    hidden, _ = model(input_ids, meta, kv.layers, backend)
    logits = model.compute_logits(hidden[to_device(last_rows, hidden.device)], fp32=False)
    argmax_rows(logits).tolist()  # as a greedy step takes its tokens
