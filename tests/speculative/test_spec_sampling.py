"""Sampled speculation keeps the target distribution (rejection sampling is lossless)."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.layers.sampler import SamplingTensors, filter_logits
from specserve.runtime.verify import verify


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a / a.sum() - b / b.sum()).abs().sum().item()


def _st(n, temperature=1.0, top_p=1.0, seed0=0):
    return SamplingTensors(
        temperature=torch.full((n,), temperature),
        top_k=torch.zeros(n, dtype=torch.int64),
        top_p=torch.full((n,), top_p),
        min_p=torch.zeros(n),
        seeds=torch.arange(seed0, seed0 + n, dtype=torch.int64),
        positions=torch.full((n,), 10, dtype=torch.int64),
        all_greedy=False,
        any_top_k_or_p=top_p < 1.0,
        any_min_p=False,
    )


@pytest.mark.parametrize("top_p", [1.0, 0.8])
@pytest.mark.parametrize("deterministic_drafts", [False, True])
def test_verify_first_two_tokens_follow_target(top_p, deterministic_drafts):
    """200k independent rows, vocabulary 6, K=2: the committed first and second tokens
    follow the target's (filtered) distributions. With 200k samples the TV distance of an
    exact sampler is about 0.002; the tolerance 0.01 catches any real bias (a drafter that
    leaked into the output would shift it by > 0.1 here)."""
    n, vocab, k = 200_000, 6, 2
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(k + 1, vocab, generator=gen) * 1.5
    draft = torch.randn(k, vocab, generator=gen) * 1.5
    st = _st(n, top_p=top_p)
    p = filter_logits(target, _st(k + 1, top_p=top_p)).softmax(-1)
    q = filter_logits(draft, _st(k, top_p=top_p)).softmax(-1)
    # Drafts drawn from q (or fixed at the target's mode for a deterministic drafter).
    if deterministic_drafts:
        drafts = p[:k].argmax(-1).repeat(n, 1)
        probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[j], n, True, generator=gen) for j in range(k)], 1)
        probs = q[None].expand(n, k, vocab)
    res = verify(target[None].expand(n, k + 1, vocab), drafts, torch.full((n,), k), st, probs)
    first = torch.bincount(res.tokens[:, 0], minlength=vocab).float()
    assert _tv(first, p[0]) < 0.01
    # Second token: among rows that committed at least 2 tokens, whose first token was x,
    # it follows p[1] (the target's next distribution does not depend on x in this setup).
    two = res.accept_len >= 1
    assert two.sum() > 10_000
    second = torch.bincount(res.tokens[two, 1], minlength=vocab).float()
    assert _tv(second, p[1]) < 0.015


def test_engine_sampled_speculation_matches_plain(tiny_llama, tmp_path):
    """End to end: 2000 seeded requests, with and without a random draft model (K=2).
    The first token comes from prefill; tokens 2 and 3 come out of verification. top_k 4
    keeps each marginal's support small (at most 16 and 64 tokens); two exact samplers
    differ by TV ~0.03-0.08 at this size, so the tolerance is 0.12 — a verifier that
    accepted drafts unchecked lands well above it (checked by mutation)."""
    from tests.support.tiny_models import make_tiny_model

    draft = make_tiny_model(tmp_path / "d", "llama", seed=5, num_layers=1)
    prompt = [5, 17, 33, 90]
    n = 2000

    def marginals(llm, seed_offset):
        ps = [
            SamplingParams(
                max_tokens=3,
                temperature=1.0,
                top_k=4,
                top_p=0.95,
                seed=s + seed_offset,
                ignore_eos=True,
            )
            for s in range(n)
        ]
        outs = llm.generate([prompt] * n, ps)
        counts = [{}, {}, {}]
        for o in outs:
            for i, t in enumerate(o.token_ids):
                counts[i][t] = counts[i].get(t, 0) + 1
        return counts, outs

    plain, _ = marginals(LLM(str(tiny_llama), max_num_seqs=n, max_num_batched_tokens=8192), 0)
    spec_llm = LLM(
        str(tiny_llama),
        speculative_algorithm="draft",
        speculative_draft_model_path=str(draft),
        speculative_num_steps=2,
        speculative_policy="fixed",
        max_num_seqs=n,
        max_num_batched_tokens=8192,
    )
    spec, outs = marginals(spec_llm, 100_000)
    assert sum(o.spec_stats.drafted for o in outs) >= n
    for a_counts, b_counts in zip(plain, spec):
        keys = sorted(set(a_counts) | set(b_counts))
        a = torch.tensor([a_counts.get(key, 0) for key in keys], dtype=torch.float)
        b = torch.tensor([b_counts.get(key, 0) for key in keys], dtype=torch.float)
        assert _tv(a, b) < 0.12
