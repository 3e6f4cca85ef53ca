"""Verification of draft tokens against the target in one pass, lossless.

Greedy rows accept drafts while they equal the target's argmax and take the argmax after
the last accepted one as the bonus token. Sampled rows come in two kinds:

- Coupled (a request with its own seed, or drafts that are not drawn from a distribution):
  every verify row draws the token the plain sampler would draw there (the argmax of the
  temperature / top-k / top-p / min-p filtered logits plus the counter-based Gumbel noise
  of the row's own position, stream 0: `layers.sampler`), and drafts are accepted while
  they equal those draws. Every committed token is then the one plain decoding draws at
  its position after the same tokens: a seeded request's tokens are the same with or
  without speculation, whatever the draft lengths, the batch or preemption. Its drafters
  draw with the same noise (speculative/proposer.py `draw_drafts`), so a drafter that
  agrees with the target drafts exactly its draws.
- Rejection sampling (no seed of its own, drafts drawn from the drafter's distribution q):
  accept draft x with probability min(1, p(x)/q(x)); after a rejection draw from
  norm(max(0, p - q)), after full acceptance from p. It accepts 1 - TV(p, q) of drafts,
  where the coupled draw accepts at least (1 - TV) / (1 + TV) (about 5-15% fewer on peaked
  distributions); its tokens follow p but depend on the draft lengths, which a request
  without a seed never reproduces anyway.

Both are exact: each committed token follows the target's shaped distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specserve.layers.sampler import (
    STREAM_STRIDE,
    SamplingTensors,
    argmax_rows,
    filter_logits,
    gumbel_noise,
    hash_uniform,
    sample,
)

ACCEPT_STREAM = 2
SIMULATE_STREAM = 3
SIMULATE_OFFSET = SIMULATE_STREAM * STREAM_STRIDE  # (the simulated draws' seed offset)


@dataclass
class VerifyResult:
    """tokens[r, :accept_len[r] + 1] are request r's new tokens (accepted drafts + bonus);
    the entries after them may hold anything."""

    tokens: torch.Tensor  # [R, K+1] int64
    accept_len: torch.Tensor  # [R] int64


def _uniforms(seeds: torch.Tensor, positions: torch.Tensor, max_draft_len: int, stream: int):
    """[R, K] uniforms, one per draft position, from (seed, position, stream)."""
    counters = positions[:, None] + torch.arange(max_draft_len, device=positions.device)
    seeds = (seeds + stream * STREAM_STRIDE)[:, None].expand(-1, max_draft_len)
    return hash_uniform(seeds.reshape(-1), counters.reshape(-1), 1).view(-1, max_draft_len)


def _accepted(ok: torch.Tensor) -> torch.Tensor:
    """[R] accept lengths from per-draft decisions [R, K]: the leading run of accepted ones."""
    return ok.long().cumprod(dim=1).sum(dim=1)


def greedy_accept_lens(ids: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """[B] accept lengths of greedy verification for a verify step's input ids [B, q_len]
    (the last committed token, then q_len - 1 drafts) and its rows' argmaxes [B, q_len]:
    `verify_greedy` where every request drafts q_len - 1, in the form a CUDA graph takes it
    from its static inputs (runtime/cuda_graphs.py)."""
    return _accepted(ids[:, 1:] == choice[:, :-1])


def verify_greedy(
    target_logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_lens: torch.Tensor | None,
    seeds: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    simulate_rate: float | None = None,
    greedy_choice: torch.Tensor | None = None,
) -> VerifyResult:
    """`verify` for rows that are all greedy: accept drafts while they equal the target's
    argmax, then its argmax as the bonus. Needs no sampling tensors (seeds and positions
    only to simulate acceptance), so a greedy speculative step uploads almost nothing;
    `draft_lens` None: every row has K drafts. `greedy_choice`: the rows' draws [R, K+1] where
    the caller has them already (the logits' argmax a CUDA graph took with them; `verify`'s
    sampled draws), else the argmax, computed.

    Row r's tokens past accept_len[r] are unspecified (never committed nor read): without
    simulation the argmax row itself is returned, whose first accept_len + 1 entries are the
    accepted drafts (each equals the argmax there) and the bonus."""
    max_draft_len = target_logits.shape[1] - 1
    if greedy_choice is None:
        greedy_choice = argmax_rows(target_logits)  # [R, K+1]
    if simulate_rate is not None and drafts.is_cuda:  # the same, in one kernel
        from specserve.kernels.counter_noise import simulated_verify

        args = (seeds, positions, draft_lens, drafts, greedy_choice, simulate_rate, SIMULATE_OFFSET)
        return VerifyResult(*simulated_verify(*args))
    if simulate_rate is None:
        ok = drafts == greedy_choice[:, :max_draft_len]
    else:
        ok = _uniforms(seeds, positions, max_draft_len, SIMULATE_STREAM) < simulate_rate
    if draft_lens is not None:
        ok &= torch.arange(max_draft_len, device=drafts.device)[None, :] < draft_lens[:, None]
    accept_len = _accepted(ok)
    if simulate_rate is None:
        return VerifyResult(greedy_choice, accept_len)
    bonus = greedy_choice.gather(1, accept_len[:, None])[:, 0]
    return VerifyResult(_assemble(drafts, bonus, accept_len), accept_len)


def verify(
    target_logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_lens: torch.Tensor | None,
    st: SamplingTensors,
    draft_probs: torch.Tensor | None = None,
    simulate_rate: float | None = None,
) -> VerifyResult:
    """Verify padded drafts: coupled to the plain sampler's draws, and by rejection sampling
    the rows whose drafts were drawn from a distribution (see the module's docstring).

    target_logits: [R, K+1, V] target logits at the last committed token and each draft
    (logit changes in); drafts: [R, K] draft token ids (anything past draft_lens[r] is
    ignored; draft_lens None: every request drafts K); st: per-row sampling tensors whose
    `positions` are the index of the first token drawn (the one after the last committed
    token), row j of a request drawing at that position + j; draft_probs: [R, K, V] the
    drafter's filtered distributions of the rows verified by rejection sampling (zero on
    the others), None when there are none. `simulate_rate` replaces each acceptance
    decision by a seeded draw with that probability (benchmarking random-weight models
    only: the output is then not the model's).
    """
    if st.all_greedy:
        return verify_greedy(
            target_logits, drafts, draft_lens, st.seeds, st.positions, simulate_rate
        )
    num_rows, q_len, vocab = target_logits.shape
    rep = lambda t: t.repeat_interleave(q_len)  # noqa: E731
    offsets = torch.arange(q_len, device=drafts.device)
    rows = replace(
        st,
        temperature=rep(st.temperature),
        top_k=rep(st.top_k),
        top_p=rep(st.top_p),
        min_p=rep(st.min_p),
        seeds=rep(st.seeds),
        positions=(st.positions[:, None] + offsets).reshape(-1),
    )
    draws = sample(target_logits.reshape(num_rows * q_len, vocab), rows).view(num_rows, q_len)
    coupled = verify_greedy(
        target_logits, drafts, draft_lens, st.seeds, st.positions, simulate_rate, draws
    )
    if draft_probs is None or simulate_rate is not None or q_len == 1:
        return coupled
    if draft_lens is None:
        draft_lens = torch.full((num_rows,), q_len - 1, device=drafts.device)
    rejecting = (draft_probs[:, 0].sum(dim=-1) > 0) & (st.temperature > 0)  # [R]
    drawn = _rejection_sampled(target_logits, drafts, draft_lens, st, draft_probs)
    accept_len = torch.where(rejecting, drawn.accept_len, coupled.accept_len)
    tokens = torch.where(rejecting[:, None], drawn.tokens, coupled.tokens)
    return VerifyResult(tokens, accept_len)


def _rejection_sampled(target_logits, drafts, draft_lens, st, draft_probs) -> VerifyResult:
    """Rejection sampling of every row against its drafter's distribution (`verify` keeps
    it for the rows drawn from one): accept x with min(1, p(x)/q(x)); the bonus from the
    residual max(0, p - q) after a rejection, from p after full acceptance."""
    num_rows, q_len, vocab = target_logits.shape
    max_draft_len = q_len - 1
    valid = torch.arange(max_draft_len, device=drafts.device)[None, :] < draft_lens[:, None]
    rep = lambda t: t.repeat_interleave(q_len)  # noqa: E731
    flat = replace(st, temperature=rep(st.temperature), top_k=rep(st.top_k), top_p=rep(st.top_p))
    flat = replace(flat, min_p=rep(st.min_p))
    filtered = filter_logits(target_logits.reshape(num_rows * q_len, vocab), flat)
    filtered = filtered.view(num_rows, q_len, vocab)
    p = filtered.softmax(dim=-1)
    index = drafts[:, :, None].clamp(min=0)
    p_draft = p[:, :max_draft_len].gather(2, index)[:, :, 0]
    q_draft = draft_probs.gather(2, index)[:, :, 0]
    u = _uniforms(st.seeds, st.positions, max_draft_len, ACCEPT_STREAM)
    accept_len = _accepted((u * q_draft < p_draft) & valid)
    at_final = accept_len[:, None, None].expand(-1, 1, vocab)
    final_logits = filtered.gather(1, at_final)[:, 0]
    p_final = p.gather(1, at_final)[:, 0]
    at = accept_len.clamp(max=max_draft_len - 1)
    q_final = draft_probs.gather(1, at[:, None, None].expand(-1, 1, vocab))[:, 0]
    residual = (p_final - q_final).clamp(min=0)
    # Guard rounding: if nothing is left, fall back to p (a probability-zero event).
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p_final, residual)
    rejected = accept_len < draft_lens
    final_logits = torch.where(rejected[:, None], residual.log(), final_logits)
    noise = gumbel_noise(replace(st, positions=st.positions + accept_len), vocab)
    bonus = argmax_rows(final_logits + noise)
    return VerifyResult(_assemble(drafts, bonus, accept_len), accept_len)


def _assemble(drafts, bonus, accept_len) -> torch.Tensor:
    tokens = torch.cat([drafts, torch.zeros_like(bonus)[:, None]], dim=1)
    return tokens.scatter(1, accept_len[:, None], bonus[:, None])


def rate_for_mean_accept_len(mean_len: float, draft_len: int) -> float:
    """The per-token acceptance rate a whose expected tokens per verify step at draft length
    K = draft_len, (1 - a^(K+1)) / (1 - a), equals mean_len (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(draft_len + 1)) < mean_len:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
