"""Verification of draft tokens against the target in one pass, lossless.

Greedy rows accept drafts while they equal the target's argmax, then take the argmax at the
first mismatch (or after the last draft) as the bonus token. Sampled rows use rejection
sampling: accept draft x with probability min(1, p(x)/q(x)); on rejection draw from
norm(max(0, p - q)); after all drafts are accepted draw the bonus from p. p and q are the
temperature / top-k / top-p / min-p filtered distributions of target and drafter.

A row with no drafts reduces exactly to the plain sampler: the final draw uses the same
counter-based Gumbel noise (stream 0 at the drawn token's position) as `layers.sampler`.
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
)

ACCEPT_STREAM = 2
SIMULATE_STREAM = 3


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
    `draft_lens` None: every row has K drafts. `greedy_choice`: the logits' argmax [R, K+1]
    where the caller has it already (a CUDA graph took it with the logits), else computed.

    Row r's tokens past accept_len[r] are unspecified (never committed nor read): without
    simulation the argmax row itself is returned, whose first accept_len + 1 entries are the
    accepted drafts (each equals the argmax there) and the bonus."""
    max_draft_len = target_logits.shape[1] - 1
    if greedy_choice is None:
        greedy_choice = argmax_rows(target_logits)  # [R, K+1]
    if simulate_rate is not None and drafts.is_cuda:  # the same, in one kernel
        from specserve.kernels.counter_noise import simulated_verify

        offset = SIMULATE_STREAM * STREAM_STRIDE
        args = (seeds, positions, draft_lens, drafts, greedy_choice, simulate_rate, offset)
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
    draft_lens: torch.Tensor,
    st: SamplingTensors,
    draft_probs: torch.Tensor | None = None,
    simulate_rate: float | None = None,
) -> VerifyResult:
    """Verify padded drafts.

    target_logits: [R, K+1, V] target logits at the last committed token and each draft;
    drafts: [R, K] draft token ids (anything past draft_lens[r] is ignored);
    draft_probs: [R, K, V] the drafter's filtered distributions (None: point masses, i.e.
    deterministic drafts); st: per-row sampling tensors whose `positions` are the index of
    the first token drawn (the one after the last committed token). `simulate_rate`
    replaces each acceptance decision by a seeded draw with that probability (benchmarking
    random-weight models only: the output is then not the model's).
    """
    if st.all_greedy:
        return verify_greedy(
            target_logits, drafts, draft_lens, st.seeds, st.positions, simulate_rate
        )
    num_rows, max_q_len, vocab = target_logits.shape
    max_draft_len = max_q_len - 1
    # [R, K]
    valid = torch.arange(max_draft_len, device=drafts.device)[None, :] < draft_lens[:, None]
    greedy_choice = argmax_rows(target_logits)  # [R, K+1]
    greedy_ok = (drafts == greedy_choice[:, :max_draft_len]) & valid
    simulated = simulate_rate is not None

    rep = lambda t: t.repeat_interleave(max_q_len)  # noqa: E731
    flat_st = replace(
        st,
        temperature=rep(st.temperature),
        top_k=rep(st.top_k),
        top_p=rep(st.top_p),
        min_p=rep(st.min_p),
    )
    filtered = filter_logits(target_logits.reshape(num_rows * max_q_len, vocab), flat_st)
    filtered = filtered.view(num_rows, max_q_len, vocab)
    p = filtered.softmax(dim=-1)
    if simulated:
        ok = (
            _uniforms(st.seeds, st.positions, max_draft_len, SIMULATE_STREAM) < simulate_rate
        ) & valid
    elif max_draft_len:
        index = drafts[:, :, None].clamp(min=0)
        p_draft = p[:, :max_draft_len].gather(2, index)[:, :, 0]
        q_draft = (
            torch.ones_like(p_draft)
            if draft_probs is None
            else (draft_probs.gather(2, index)[:, :, 0])
        )
        u = _uniforms(st.seeds, st.positions, max_draft_len, ACCEPT_STREAM)
        sampled_ok = (u * q_draft < p_draft) & valid
        ok = torch.where(st.temperature[:, None] > 0, sampled_ok, greedy_ok)
    else:
        ok = greedy_ok
    accept_len = ok.long().cumprod(dim=1).sum(dim=1)

    # The final draw: residual max(0, p - q) after a rejection, p itself after full acceptance
    # (drawn from the filtered logits themselves, exactly as the plain sampler does).
    at_final = accept_len[:, None, None].expand(-1, 1, vocab)
    final_logits = filtered.gather(1, at_final)[:, 0]
    if max_draft_len and not simulated:
        p_final = p.gather(1, at_final)[:, 0]
        at = accept_len.clamp(max=max_draft_len - 1)
        if draft_probs is None:
            q_final = torch.zeros_like(p_final)
            q_final.scatter_(1, drafts.gather(1, at[:, None]).clamp(min=0), 1.0)
        else:
            q_final = draft_probs.gather(1, at[:, None, None].expand(-1, 1, vocab))[:, 0]
        residual = (p_final - q_final).clamp(min=0)
        # Guard rounding: if nothing is left, fall back to p (a probability-zero event).
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p_final, residual)
        rejected = accept_len < draft_lens
        final_logits = torch.where(rejected[:, None], residual.log(), final_logits)
    noise = gumbel_noise(replace(st, positions=st.positions + accept_len), vocab)
    drawn = argmax_rows(final_logits + noise)
    greedy_bonus = greedy_choice.gather(1, accept_len[:, None])[:, 0]
    bonus = torch.where(st.temperature > 0, drawn, greedy_bonus)
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
