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


def shapes_step(sampled) -> bool:
    """Whether any sampled request of a step has its logits changed."""
    return any(s.request.shapes_logits for s in sampled)


def shape_logits(logits: torch.Tensor, step, grammars: GrammarCompiler | None) -> torch.Tensor:
    """A copy of `logits` ([rows, vocab]: each sampled request's rows in order, its last
    committed token's, then one per draft; `step` the StepInput they came from) with each
    request's changes applied, its grammar's mask last (`grammars`: the engine's compiler,
    runtime/grammar.py). A row j draws the request's generated token number
    `num_generated + j` (counted from 0)."""
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
    if biases:
        index = (
            torch.tensor(bias_rows, device=device),
            torch.tensor(bias_tokens, device=device),
        )
        out.index_put_(index, torch.tensor(biases, device=device, dtype=out.dtype), accumulate=True)
    if mask_rows:
        index = (
            torch.tensor(mask_rows, device=device),
            torch.tensor(mask_tokens, device=device),
        )
        out.index_put_(index, torch.tensor(float("-inf"), device=device, dtype=out.dtype))
    if grammars is not None:
        mask_grammars(out, step, grammars)
    return out


def _penalize(out: torch.Tensor, step) -> None:
    """The penalties, in place, on the rows of penalized requests: each row's counts are its
    request's output tokens (the host's, exact: see the module docstring) plus the drafts
    before the row (read from the step's input ids on the device)."""
    device, vocab_size = out.device, out.shape[-1]
    spans = []  # (request, its first logit row, rows, its first row of the counts)
    draft_rows, draft_inputs = [], []  # (a count row, the input row of a draft before it)
    offset = total = 0
    for s in step.sampled:
        rows = s.drafted + 1
        if s.request.penalized:
            spans.append((s.request, offset, rows, total))
            for j in range(1, rows):  # row j counts drafts 0..j-1
                draft_rows += [total + j] * j
                draft_inputs += step.sample_rows[offset + 1 : offset + 1 + j]
            total += rows
        offset += rows
    if not spans:
        return
    counts = torch.zeros(total, vocab_size, device=device, dtype=torch.float32)
    seen = torch.zeros(total, vocab_size, device=device, dtype=torch.bool)  # prompt tokens
    for req, _, rows, first in spans:
        output = req.output_token_ids + req.unprocessed_token_ids
        if output:
            ids = torch.tensor(output, device=device)
            counts[first : first + rows] = torch.bincount(ids, minlength=vocab_size).float()
        if req.params.repetition_penalty != 1.0:
            seen[first : first + rows, torch.tensor(req.prompt_token_ids, device=device)] = True
    if draft_rows:
        tokens = step.input_ids[torch.tensor(draft_inputs, device=device)].long()
        rows_t = torch.tensor(draft_rows, device=device)
        counts.index_put_((rows_t, tokens), torch.ones(len(draft_rows), device=device), True)
    seen |= counts > 0

    def per_row(name: str) -> torch.Tensor:
        values = [getattr(req.params, name) for req, _, rows, _ in spans for _ in range(rows)]
        return torch.tensor(values, device=device, dtype=torch.float32)[:, None]

    logit_rows = torch.tensor(
        [start + j for _, start, rows, _ in spans for j in range(rows)], device=device
    )
    logits = out[logit_rows].float()
    repetition = per_row("repetition_penalty")
    logits = torch.where(
        seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits
    )
    logits -= per_row("frequency_penalty") * counts
    logits -= per_row("presence_penalty") * (counts > 0)
    out[logit_rows] = logits.to(out.dtype)
