"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token after the first
rated by the row of the token before it, read from the hidden states of the step that
prefills it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specserve.core.batch import ScheduledRequest
from specserve.model.llama import LlamaForCausalLM
from specserve.runtime.packing import to_device
from specserve.runtime.sampled_tokens import TokenLogprobs, logprob_tensors

if TYPE_CHECKING:
    from specserve.runtime.step_input import StepInput


def rated_chunks(batch: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The step's prompt chunks whose requests ask for prompt logprobs (prefill chunks come
    last in a step, after its decode and verify rows), last first."""
    rated = []
    for s in reversed(batch):
        if s.decoding:
            break
        if s.request.params.prompt_logprobs is not None:
            rated.append(s)
    return rated


def prompt_logprobs(
    model: LlamaForCausalLM, batch: list[ScheduledRequest], step: StepInput, hidden: torch.Tensor
) -> None:
    """The logprobs of the prompt tokens that `batch`'s rated chunks (`rated_chunks`) feed,
    appended to each request's `prompt_logprobs`: the row of position p rates prompt token
    p + 1. `step` is the step's packed input, `hidden` its forward's hidden states; called
    before the chunks' tokens are counted cached. Read at once, as the step's graph outputs
    are overwritten by the next replay; the copy to the host waits for this step (a rare
    request). Every step calls it: one look at the batch's last row when none asks."""
    chunks = rated_chunks(batch)
    if chunks:  # (inference mode costs microseconds to enter: only then)
        _rate(model, batch, chunks, step, hidden)


@torch.inference_mode()
def _rate(model, batch, chunks, step: StepInput, hidden: torch.Tensor) -> None:
    first_rows = {id(s): row for s, row in zip(batch, step.first_rows)}
    rows, targets, spans = [], [], []
    for s in chunks:
        req, start = s.request, s.request.cached_len
        prompt, done = req.prompt_token_ids, req.prompt_logprobs
        if not done:
            done.append(None)  # the first prompt token is rated by nothing
        lo, hi = max(start, len(done) - 1), min(start + s.num_tokens, len(prompt) - 1)
        if lo < hi:  # (a recomputed prompt, after a preemption, is rated once)
            spans.append((req, req.params.prompt_logprobs, len(rows), hi - lo))
            row = first_rows[id(s)] - start
            rows += range(row + lo, row + hi)
            targets += prompt[lo + 1 : hi + 1]
    if not rows:
        return
    device = hidden.device
    logits = model.compute_logits(hidden[to_device(rows, device)], True)
    k = max(want for _, want, _, _ in spans)
    chosen, top_lp, top_ids = logprob_tensors(logits, to_device(targets, device), k)
    chosen, top_lp, top_ids = chosen.tolist(), top_lp.tolist(), top_ids.tolist()
    for req, want, at, n in spans:
        for r in range(at, at + n):
            top = list(zip(top_ids[r][:want], top_lp[r][:want]))
            req.prompt_logprobs.append(TokenLogprobs(chosen[r], top))
