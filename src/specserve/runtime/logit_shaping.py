"""Per-request changes to a step's logits before anything is drawn from them: `logit_bias`
added, and EOS and the stop tokens masked while fewer than `min_tokens` tokens are generated
(SamplingParams). They apply to every logit row a request has in the step (its last
committed token's and each draft's, each at its own output position), so verification sees
the distribution plain decoding draws from, and greedy output with speculation stays plain
decoding's. The drafters draft without them (their drafts are then rejected more often)."""

from __future__ import annotations

import torch


def shapes_step(sampled) -> bool:
    """Whether any sampled request of a step has its logits changed."""
    return any(s.request.params.shapes_logits for s in sampled)


def shape_logits(logits: torch.Tensor, sampled) -> torch.Tensor:
    """A copy of `logits` ([rows, vocab]: each sampled request's rows in order, its last
    committed token's, then one per draft) with each request's changes applied. A row j
    draws the request's generated token number `num_generated + j` (counted from 0; the host
    count, exact once the step in flight is resolved where it matters: the step loop waits
    for it while a request's min_tokens is near, `StepLoop._wait_reason`)."""
    vocab_size = logits.shape[-1]
    bias_rows, bias_tokens, biases = [], [], []
    mask_rows, mask_tokens = [], []
    offset = 0
    for s in sampled:
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
    out = logits.clone()
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
    return out
