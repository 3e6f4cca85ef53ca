"""Per-request changes to a step's logits before anything is drawn from them, in this order:
the penalties (`repetition_penalty` over the prompt and output tokens, then
`frequency_penalty` and `presence_penalty` over the output tokens), `logit_bias`, and EOS
and the stop tokens masked while fewer than `min_tokens` tokens are generated
(SamplingParams), then the mask of a request's grammar (runtime/grammar.py). They apply
to every logit row a request has in the step (its last
committed token's and each draft's, each at its own output position, the drafts before a
row counting as generated for it), so verification sees the distribution plain decoding
draws from, and greedy output with speculation stays plain decoding's. The drafters draft
without them (their drafts are then rejected more often).

The host's token counts are exact where they matter: the step loop reads the step in
flight's tokens before the next one samples when a request of it is penalized, constrained
or its min_tokens hangs on that step's count (engine/overlap_wait.py: sampling_reason).
Drafts are read where they are, on the device."""

from __future__ import annotations

import torch

from specserve.runtime.grammar import GrammarCompiler, mask_grammars
from specserve.runtime.packing import to_device, upload


def shapes_step(sampled) -> bool:
    """Whether any sampled request of a step has its logits changed."""
    return any(s.request.shapes_logits for s in sampled)


def shape_logits(logits: torch.Tensor, step, grammars: GrammarCompiler | None) -> torch.Tensor:
    """A copy of `logits` ([rows, vocab]: each sampled request's rows in order, its last
    committed token's, then one per draft; `step` the StepInput they came from) with each
    request's changes applied, its grammar's mask last (`grammars`: the engine's compiler,
    runtime/grammar.py). A row j draws the request's generated token number
    `num_generated + j` (counted from 0).

    The host's lists reach the device through pinned copies and nothing here reads the
    device back: these changes are made while the step's forward runs (a list copied from
    pageable memory, or a count sized on the device, would wait for that forward)."""
    out = logits.clone()
    _penalize(out, step)
    vocab_size = logits.shape[-1]
    bias_rows, bias_tokens, biases = [], [], []
    mask_rows, mask_tokens = [], []
    offset = 0
    for s in step.sampled:
        req, rows = s.request, s.drafted + 1
        p = req.params
        if p.logit_bias:
            tokens, values = list(p.logit_bias), list(p.logit_bias.values())
            for j in range(offset, offset + rows):
                bias_rows += [j] * len(tokens)
                bias_tokens += tokens
                biases += values
        blocked = p.min_tokens - req.num_generated  # rows that may not end the output
        if blocked > 0:
            stops = [t for t in req.stop_ids if t < vocab_size]  # (others are never drawn)
            for j in range(offset, offset + min(rows, blocked)):
                mask_rows += [j] * len(stops)
                mask_tokens += stops
        offset += rows
    device = logits.device
    if biases or mask_rows:
        b_rows, b_tokens, m_rows, m_tokens = upload(
            [bias_rows, bias_tokens, mask_rows, mask_tokens], device
        )
        if biases:
            values = to_device(biases, device, torch.float32).to(out.dtype)
            out.index_put_((b_rows, b_tokens), values, accumulate=True)
        if mask_rows:
            out.index_put_((m_rows, m_tokens), out.new_full((), float("-inf")))
    if grammars is not None:
        mask_grammars(out, step, grammars)
    return out


def _penalize(out: torch.Tensor, step) -> None:
    """The penalties, in place, on the rows of penalized requests: each row's counts are its
    request's output tokens (the host's, exact: see the module docstring) plus the drafts
    before the row (read from the step's input ids on the device). Counted on the device
    per request, in one pass over every penalized request's tokens."""
    device, vocab_size = out.device, out.shape[-1]
    reqs = []  # the penalized requests, numbered in order
    token_reqs, tokens = [], []  # each output token of each (its request's number, it)
    prompt_reqs, prompt_tokens = [], []  # likewise the prompts under a repetition penalty
    logit_rows, row_reqs = [], []  # each penalized logit row, its request's number
    draft_rows, draft_inputs = [], []  # (a row of those, the input row of a draft before it)
    offset = 0
    for s in step.sampled:
        req, rows = s.request, s.drafted + 1
        if req.penalized:
            n = len(reqs)
            reqs.append(req)
            for output in (req.output_token_ids, req.unprocessed_token_ids):
                tokens += output
                token_reqs += [n] * len(output)
            if req.params.repetition_penalty != 1.0:
                prompt_tokens += req.prompt_token_ids
                prompt_reqs += [n] * len(req.prompt_token_ids)
            first = len(logit_rows)
            for j in range(1, rows):  # row j counts drafts 0..j-1
                draft_rows += [first + j] * j
                draft_inputs += step.sample_rows[offset + 1 : offset + 1 + j]
            logit_rows += range(offset, offset + rows)
            row_reqs += [n] * rows
        offset += rows
    if not reqs:
        return
    lists = [token_reqs, tokens, prompt_reqs, prompt_tokens, logit_rows, row_reqs]
    token_reqs_t, tokens_t, prompt_reqs_t, prompt_t, logit_rows_t, row_reqs_t, *drafts = upload(
        lists + [draft_rows, draft_inputs], device
    )
    counts = torch.zeros(len(reqs), vocab_size, device=device, dtype=torch.float32)
    counts.index_put_(
        (token_reqs_t, tokens_t), torch.ones(len(tokens), device=device), accumulate=True
    )
    seen = torch.zeros(len(reqs), vocab_size, device=device, dtype=torch.bool)  # prompts
    seen.index_put_((prompt_reqs_t, prompt_t), seen.new_ones(()))
    counts, seen = counts[row_reqs_t], seen[row_reqs_t]  # per logit row
    if draft_rows:
        draft_rows_t, draft_inputs_t = drafts
        drafted = step.input_ids[draft_inputs_t].long()
        counts.index_put_(
            (draft_rows_t, drafted), torch.ones(len(draft_rows), device=device), accumulate=True
        )
    seen |= counts > 0
    names = ("repetition_penalty", "frequency_penalty", "presence_penalty")
    values = [getattr(reqs[n].params, name) for name in names for n in row_reqs]
    repetition, frequency, presence = (
        to_device(values, device, torch.float32).view(3, len(row_reqs), 1).unbind(0)
    )
    logits = out[logit_rows_t].float()
    logits = torch.where(
        seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits
    )
    logits -= frequency * counts
    logits -= presence * (counts > 0)
    out[logit_rows_t] = logits.to(out.dtype)
