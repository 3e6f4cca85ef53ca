"""The training-time test: the head unrolled on its own outputs for several steps, with the
loss of every step against the target's next-token distribution over the draft vocabulary.

Alignment (as EAGLE-3 and SpecForge): at anchor i, step 0 reads (fc(target features of token
i), embedding of token i+1) at rotary position i and predicts token i+2. Step k reads (the
head's own step k-1 output at anchor i, embedding of token i+k+1) at position i+k and
predicts token i+k+2. It attends to the step-0 entries of anchors 0..i (the committed context,
built from target features) and to anchor i's own entries of steps 1..k (the draft chain),
exactly what the paged head sees when it drafts k+1 tokens after committed token i+1. Tokens
fed are the data's (the target's own), so a step counts when all earlier steps were right.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.model.eagle3 import Eagle3Head
from specserve.train.features import Batch


def ttt_mask(length: int, step: int, device: torch.device) -> torch.Tensor:
    """[L, L*(step+1)] bool, True = attend: step-0 keys causally, then one diagonal block for
    each of steps 1..step."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, i + k] at column i, zero past the end."""
    if k == 0:
        return x
    pad = torch.zeros_like(x[:, :k])
    return torch.cat([x[:, k:], pad], dim=1)


@dataclass
class UnrollOutput:
    """Per unrolled step: loss, and which anchors were scored and predicted right."""

    loss: torch.Tensor  # weighted sum over steps (scalar)
    step_losses: torch.Tensor  # [steps] each step's loss, detached (read it when logging)
    valid: list[torch.Tensor]  # [B, L] bool: step k predicts a reply token that exists
    correct: list[torch.Tensor]  # [B, L] bool: the head's token is the target's greedy one


def unroll(
    head: Eagle3Head,
    embed_weight: torch.Tensor,
    target_head: torch.Tensor,
    batch: Batch,
    steps: int,
    decay: float = 0.8,
) -> UnrollOutput:
    """Run `steps` unrolled steps over a batch. `target_head` [draft_vocab, H] holds the rows
    of the target's lm_head for the draft vocabulary (the target's logits restricted to it);
    the loss of step k is weighted decay**k.

    Which positions each step scores comes from the batch's lengths on the host, so no step
    waits for the device (no `nonzero` on device tensors)."""
    b, n = batch.tokens.shape
    device = batch.tokens.device
    idx = torch.arange(n, device=device)[None, :]
    host_idx = torch.arange(n)[None, :]
    host_lengths = torch.tensor(batch.host_lengths)[:, None]
    host_prompt_lens = torch.tensor(batch.host_prompt_lens)[:, None]
    hidden = head.project(batch.aux)
    positions = idx.expand(b, n)
    # A column past its sample's last token (padding, or an anchor whose step k predicts
    # nothing) keeps that token's position: i + k would run past the rotary table for a
    # sample near the target's context. Such columns are never scored, and no scored
    # column attends to them (step 0 causally, steps 1..k on the anchor's own diagonal).
    last = batch.lengths[:, None] - 1
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    total = torch.zeros((), device=device)
    losses, valids, corrects = [], [], []
    for k in range(steps):
        predicted = host_idx + k + 2  # index of the token step k predicts
        host_valid = (predicted < host_lengths) & (predicted >= host_prompt_lens)
        rows = tuple(r.to(device, non_blocking=True) for r in host_valid.nonzero(as_tuple=True))
        valid = host_valid.to(device, non_blocking=True)
        embeds = F.embedding(_shift(batch.tokens, k + 1), embed_weight)
        mask = ttt_mask(n, k, device) if k else None
        at = torch.minimum(positions + k, last)
        out, kv = head.forward_dense(embeds, hidden, at, past, mask)
        past.append(kv)
        hidden = out
        target_argmax = _shift(batch.argmax, k + 1)
        logits = head.compute_logits(out[rows])
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            # In the recorded features' dtype (bf16 on GPU), as the target computes its own
            # logits when it serves; softmax in fp32.
            t_hidden = _shift(batch.hidden, k + 1)[rows]
            t_logits = (t_hidden @ target_head.to(t_hidden.dtype).T).float()
            t_probs = t_logits.softmax(-1)
            t_top = target_argmax[rows]
            weight = head.t2d[t_top].float()  # a target token outside the draft vocab
            pred = head.draft_to_target(logits.argmax(-1))  # cannot be drafted: no loss
            right = (pred == t_top) & (_shift(batch.tokens, k + 2)[rows] == t_top)
        ce = -(t_probs * logits.log_softmax(-1)).sum(-1)
        step_loss = (ce * weight).sum() / weight.sum().clamp(min=1.0)
        total = total + decay**k * step_loss
        losses.append(step_loss.detach())
        correct = torch.zeros_like(valid)
        correct[rows] = right
        valids.append(valid)
        corrects.append(correct)
    return UnrollOutput(total, torch.stack(losses), valids, corrects)


def acceptance_stats(outs: list[UnrollOutput]) -> dict:
    """Teacher-forced statistics over unrolled batches.

    step_acc[k]: share of anchors, valid at step k, whose step-k token is right.
    chain[k]: share of anchors (valid at step 0) whose steps 0..k are all right, the chance
    that greedy chain drafting accepts k+1 tokens; mean_accept_len[K-1] = 1 + sum(chain[:K]),
    the expected tokens per verify step at K drafts (accepted drafts plus the bonus token)."""
    steps = len(outs[0].valid)
    right = [0] * steps
    scored = [0] * steps
    chain_hits = [0] * steps
    anchors = 0
    for o in outs:
        alive = o.valid[0].clone()
        anchors += int(alive.sum())
        for k in range(steps):
            right[k] += int(o.correct[k].sum())
            scored[k] += int(o.valid[k].sum())
            alive &= o.correct[k]
            chain_hits[k] += int(alive.sum())
    chain = [c / max(anchors, 1) for c in chain_hits]
    return {
        "step_acc": [r / max(s, 1) for r, s in zip(right, scored)],
        "chain": chain,
        "mean_accept_len": [1 + sum(chain[: k + 1]) for k in range(steps)],
        "anchors": anchors,
    }
