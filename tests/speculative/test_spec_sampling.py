"""Sampled speculation is lossless. A request with its own seed commits the plain sampler's
draws (every verify row draws what plain decoding draws at its position: runtime/verify.py),
so its tokens are the same with and without speculation, for every drafter, draft length,
batch and preemption; one without a seed is verified by rejection sampling against the
drafter's distribution, accepting more drafts. Both follow the target's distribution.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.layers.sampler import (
    SamplingTensors,
    build_sampling_tensors,
    filter_logits,
    gumbel_noise,
    sample,
)
from specserve.runtime.verify import verify
from tests.support.overlap_cases import make_models, random_draft_lens, spec_kwargs
from tests.support.tiny_models import resized_vocab_copy


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


def test_verify_commits_the_plain_samplers_draw_at_every_row():
    """Rows of mixed shaping (greedy, temperature, top-k, top-p, min-p), drafts that agree
    with the target's draws for a random number of rows: each request's committed tokens are
    the plain sampler's draws at their positions (drawn one row at a time here), and it
    accepts its drafts up to the first that differs from them."""
    gen = torch.Generator().manual_seed(0)
    num, k, vocab = 48, 3, 12
    logits = torch.randn(num, k + 1, vocab, generator=gen) * 2
    params = [
        SamplingParams(
            temperature=[0.0, 0.7, 1.0, 1.5][i % 4],
            top_k=[0, 3][i % 2],
            top_p=[1.0, 0.8, 1.0][i % 3],
            min_p=[0.0, 0.0, 0.0, 0.0, 0.2][i % 5],
        )
        for i in range(num)
    ]
    seeds, positions = list(range(100, 100 + num)), [7 + i for i in range(num)]
    draft_lens = torch.tensor([k if i % 5 else i % 3 for i in range(num)])

    def plain_draw(r: int, j: int) -> int:
        st = build_sampling_tensors([params[r]], [seeds[r]], [positions[r] + j], "cpu")
        return int(sample(logits[r, j][None], st)[0])

    draws = [[plain_draw(r, j) for j in range(k + 1)] for r in range(num)]
    agree = torch.randint(0, k + 1, (num,), generator=gen).tolist()
    drafts = torch.randint(0, vocab, (num, k), generator=gen)
    for r in range(num):
        drafts[r, : agree[r]] = torch.tensor(draws[r][: agree[r]])
    st = build_sampling_tensors(params, seeds, positions, "cpu")
    res = verify(logits, drafts, draft_lens, st)
    for r in range(num):
        want = 0
        while want < int(draft_lens[r]) and int(drafts[r, want]) == draws[r][want]:
            want += 1
        assert int(res.accept_len[r]) == want, r
        assert res.tokens[r, : want + 1].tolist() == draws[r][: want + 1], r
    assert 0 < int(res.accept_len.sum()) < int(draft_lens.sum())  # both outcomes happen


@pytest.mark.parametrize("top_p", [1.0, 0.8])
@pytest.mark.parametrize("drafts_kind", ["coupled", "rejection", "deterministic"])
def test_verify_first_two_tokens_follow_target(top_p, drafts_kind):
    """200k independent rows, vocabulary 6, K=2: the committed first and second tokens
    follow the target's (filtered) distributions, whatever the drafts: drawn from q with
    the target's noise (coupled), drawn with noise of their own and verified by rejection
    sampling against q, or fixed at the target's mode. With 200k samples the TV distance of
    an exact sampler is about 0.002; the tolerance 0.01 catches any real bias (a drafter
    that leaked into the output would shift it by > 0.1 here). Rejection sampling accepts
    1 - TV(p, q) of the first drafts; the coupled draw fewer."""
    n, vocab, k = 200_000, 6, 2
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(k + 1, vocab, generator=gen) * 1.5
    draft = torch.randn(k, vocab, generator=gen) * 1.5
    st = _st(n, top_p=top_p)
    p = filter_logits(target, _st(k + 1, top_p=top_p)).softmax(-1)
    q = filter_logits(draft, _st(k, top_p=top_p)).softmax(-1)
    probs = None
    if drafts_kind == "deterministic":
        drafts = p[:k].argmax(-1).repeat(n, 1)
    else:
        stream = 0 if drafts_kind == "coupled" else 1  # (1: noise of the drafts' own)
        at = [replace(st, positions=st.positions + j) for j in range(k)]
        drafts = torch.stack(
            [
                (
                    filter_logits(draft[j].expand(n, vocab), at[j])
                    + gumbel_noise(at[j], vocab, stream)
                ).argmax(-1)
                for j in range(k)
            ],
            1,
        )
        assert _tv(torch.bincount(drafts[:, 0], minlength=vocab).float(), q[0]) < 0.01
        if drafts_kind == "rejection":
            probs = q[None].expand(n, k, vocab)
    res = verify(target[None].expand(n, k + 1, vocab), drafts, torch.full((n,), k), st, probs)
    first_accepted = (res.accept_len >= 1).float().mean().item()
    if drafts_kind == "rejection":
        assert abs(first_accepted - (1 - _tv(p[0], q[0]))) < 0.01
    elif drafts_kind == "coupled":
        assert first_accepted < 1 - _tv(p[0], q[0]) - 0.005
    first = torch.bincount(res.tokens[:, 0], minlength=vocab).float()
    assert _tv(first, p[0]) < 0.01
    # Second token: among rows that committed at least 2 tokens, whose first token was x,
    # it follows p[1] (the target's next distribution does not depend on x in this setup).
    two = res.accept_len >= 1
    assert two.sum() > 10_000
    second = torch.bincount(res.tokens[two, 1], minlength=vocab).float()
    assert _tv(second, p[1]) < 0.015


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


PROMPTS = [[5, 17, 33, 90], [7, 8, 9, 10] * 5, [40, 41], [60 + i for i in range(19)]] * 3


def _params(i: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=20,
        temperature=[0.8, 1.0, 1.3][i % 3],
        top_k=[0, 6][i % 2],
        top_p=[1.0, 0.9, 1.0, 0.95][i % 4],
        repetition_penalty=1.3 if i % 5 == 0 else 1.0,
        seed=1000 + i,
        ignore_eos=True,
    )


@pytest.fixture(scope="module")
def plain(models):
    llm = LLM(models["target"])
    return [o.token_ids for o in llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])]


@pytest.mark.parametrize(
    "drafter, mode",
    [
        ("copy", "fixed"),
        ("random", "fixed"),
        ("ngram", "fixed"),
        ("eagle3", "fixed"),
        ("random", "random K"),
        ("eagle3", "random K, overlap"),
        ("copy", "preemption"),
        ("random", "goodput"),
    ],
)
def test_seeded_sampled_output_is_plain_decodings(models, plain, drafter, mode):
    """The same seeded requests, drafted or not, at any draft length, in one batch or
    preempted: token for token the plain sampler's output (penalties, top-k and top-p in).
    A drafter that is the target drafts exactly the target's draws: every draft accepted
    (where no penalty changes the target's logits)."""
    kw = spec_kwargs(models, drafter) | dict(speculative_num_steps=3)
    if mode == "preemption":
        kw |= dict(page_size=4, num_kv_pages=24)
    if mode == "goodput":
        kw["speculative_policy"] = "goodput"
    if "overlap" in mode:
        kw["overlap_schedule"] = "on"
    llm = LLM(models["target"], **kw)
    if "random K" in mode:
        random_draft_lens(llm)
    outs = llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    assert [o.token_ids for o in outs] == plain
    drafted = sum(o.spec_stats.drafted for o in outs)
    assert drafted > 0 or mode == "goodput"
    if drafter == "copy":  # (a drafter does not apply the penalties: every 5th request)
        unshaped = [o.spec_stats for i, o in enumerate(outs) if i % 5]
        assert sum(s.accepted for s in unshaped) == sum(s.drafted for s in unshaped) > 0
    if mode == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.allocator.num_used == 0


@pytest.mark.parametrize("drafter", ["random", "cut"])
def test_requests_without_a_seed_follow_the_targets_distribution(models, drafter, tmp_path):
    """End to end, 2000 requests without a seed, plain and with a random draft model (K=2,
    its drafts drawn from its distribution and verified by rejection sampling): the first
    three tokens' marginals agree (the first comes from prefill, the next two out of
    verification). top_k 4 keeps each marginal's support small; two exact samplers differ
    by TV ~0.03-0.08 at this size, so the tolerance is 0.12 (a verifier that accepted drafts
    unchecked lands well above it). "cut": the target itself with its embedding cut to 200
    rows, whose distribution has no mass on the ids past them (drafting over the target's
    ids, speculative/draft_model.py's fit_vocab): the target's mass there comes from the
    residual."""
    prompt, n = [5, 17, 33, 90], 2000
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, top_p=0.95, ignore_eos=True)

    def marginals(llm):
        counts = [{}, {}, {}]
        outs = llm.generate([prompt] * n, params)
        for o in outs:
            for i, t in enumerate(o.token_ids):
                counts[i][t] = counts[i].get(t, 0) + 1
        return counts, outs

    big = dict(max_num_seqs=n, max_num_batched_tokens=8192)
    plain, _ = marginals(LLM(models["target"], **big))
    if drafter == "cut":
        cut = resized_vocab_copy(Path(models["target"]), tmp_path / "cut", 200)
        models = {**models, "cut": str(cut)}
    llm = LLM(models["target"], **spec_kwargs(models, drafter), speculative_num_steps=2, **big)
    kept = []
    draft_probs = llm.engine.runner._draft_probs
    llm.engine.runner._draft_probs = lambda *a: kept.append(draft_probs(*a)) or kept[-1]
    spec, outs = marginals(llm)
    assert sum(o.spec_stats.drafted for o in outs) >= n
    assert any(p is not None for p in kept)  # rejection sampling verified them
    for a_counts, b_counts in zip(plain, spec):
        keys = sorted(set(a_counts) | set(b_counts))
        a = torch.tensor([a_counts.get(key, 0) for key in keys], dtype=torch.float)
        b = torch.tensor([b_counts.get(key, 0) for key in keys], dtype=torch.float)
        assert _tv(a, b) < 0.12
