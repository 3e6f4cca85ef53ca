"""Verification of draft tokens against the target in one pass, lossless.

Every verify row draws the token the plain sampler would draw there: the argmax for greedy
rows, for sampled rows the argmax of the temperature / top-k / top-p / min-p filtered logits
plus the counter-based Gumbel noise of the row's own position (stream 0, `layers.sampler`).
A request accepts its drafts while they equal those draws, and the draw after the last
accepted one is the bonus token. So every committed token is the one plain decoding draws
at its position after the same tokens: sampled output follows the target's distribution
exactly (it is the plain sampler's), and a seeded request's tokens are the same with or
without speculation, whatever the draft lengths, the batch or preemption. Drafters that
sample draw with the same noise (speculative/proposer.py `draw_drafts`), so a drafter whose
distribution is the target's drafts exactly its draws.

A row with no drafts is the plain sampler itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specserve.layers.sampler import (
    STREAM_STRIDE,
    SamplingTensors,
    argmax_rows,
    hash_uniform,
    sample,
)

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
    draft_lens: torch.Tensor | None,
    st: SamplingTensors,
    simulate_rate: float | None = None,
) -> VerifyResult:
    """Verify padded drafts against the plain sampler's draws at every row.

    target_logits: [R, K+1, V] target logits at the last committed token and each draft
    (logit changes in); drafts: [R, K] draft token ids (anything past draft_lens[r] is
    ignored; draft_lens None: every request drafts K); st: per-row sampling tensors whose
    `positions` are the index of the first token drawn (the one after the last committed
    token), row j of a request drawing at that position + j. `simulate_rate` replaces each
    acceptance decision by a seeded draw with that probability (benchmarking random-weight
    models only: the output is then not the model's).
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
    return verify_greedy(
        target_logits, drafts, draft_lens, st.seeds, st.positions, simulate_rate, draws
    )


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
