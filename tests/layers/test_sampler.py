"""The sampler: filters keep exactly the allowed tokens, Gumbel-max draws follow the softmax,
seeded requests reproduce whatever their batch, greedy rows are argmax."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specserve import LLM, SamplingParams
from specserve.layers.sampler import build_sampling_tensors, filter_logits, sample
from tests.support.tiny_models import VOCAB

CPU = torch.device("cpu")


def tensors(params: list[SamplingParams], seeds, positions):
    return build_sampling_tensors(params, list(seeds), list(positions), CPU)


def allowed_set(logits: np.ndarray, temperature, top_k, top_p, min_p, margin=1e-4):
    """The tokens the filters must keep, computed in float64 independently of the sampler.
    Returns None when a token sits within `margin` of a threshold (float32 may go either
    way there)."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = order[:top_k] if top_k > 0 else order
    p = np.exp(z[keep] - z[keep].max())
    p /= p.sum()
    mass_before = np.cumsum(p) - p
    if np.any(np.abs(mass_before[1:] - top_p) < margin):
        return None
    keep = keep[(mass_before < top_p) | (np.arange(len(keep)) == 0)]
    ratio = np.exp(z[keep] - z[keep].max())  # p_i / p_max, unchanged by renormalizing
    if np.any(np.abs(ratio - min_p) < margin) and min_p > 0:
        return None
    if min_p > 0:
        keep = keep[ratio >= min_p]
    return set(keep.tolist())


distinct_logits = st.lists(
    st.floats(-8, 8, allow_nan=False, allow_infinity=False), min_size=2, max_size=40
).filter(lambda xs: min(np.diff(np.sort(xs))) > 1e-3)


@given(
    logits=distinct_logits,
    temperature=st.floats(0.2, 4.0),
    top_k=st.integers(0, 45),
    top_p=st.floats(0.05, 1.0),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
)
@settings(max_examples=250, deadline=None)
def test_filters_never_emit_a_token_outside_the_allowed_set(
    logits, temperature, top_k, top_p, min_p
):
    array = np.array(logits, dtype=np.float32)
    allowed = allowed_set(array, temperature, top_k, top_p, min_p)
    assume(allowed is not None)
    rows = 64
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    st_ = tensors([params] * rows, range(1000, 1000 + rows), [5] * rows)
    batch = torch.from_numpy(array).repeat(rows, 1)
    kept = torch.isfinite(filter_logits(batch, st_)[0]).nonzero()[:, 0].tolist()
    assert set(kept) == allowed
    drawn = set(sample(batch, st_).tolist())
    assert drawn <= allowed, f"drew {sorted(drawn - allowed)} outside {sorted(allowed)}"


def test_filters_per_row_in_a_mixed_batch():
    """Each row is filtered by its own parameters, not its neighbours'."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 4)
    params = [
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, min_p=0.3),  # keeps ratio >= 0.3: e^-1 = 0.37
        SamplingParams(temperature=1.0, top_p=0.5),  # first token has 0.64 of the mass
    ]
    kept = torch.isfinite(filter_logits(logits, tensors(params, [1] * 4, [0] * 4)))
    assert kept.tolist() == [
        [True, True, False, False, False],
        [True] * 5,
        [True, True, False, False, False],
        [True, False, False, False, False],
    ]


def chi2_sf_even_df(x: float, df: int) -> float:
    """P(X > x) for a chi-square variable with an even number of degrees of freedom."""
    m = df // 2
    return math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(m))


def draw_counts(logits, params, seeds, positions) -> np.ndarray:
    n = len(seeds)
    batch = torch.tensor(logits, dtype=torch.float32).repeat(n, 1)
    tokens = sample(batch, tensors([params] * n, seeds, positions))
    return np.bincount(tokens.numpy(), minlength=len(logits))


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


# Seven tokens, so the chi-square test has 6 degrees of freedom (closed-form tail above).
LOGITS = [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5]
ALPHA = 1e-6  # a correct sampler fails this test with probability 1e-6 per case
TV_TOL = 0.015  # ~5 standard deviations of the TV distance for 40k draws over 7 tokens


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("vary", ["seed", "position"])
def test_gumbel_max_matches_softmax(temperature, vary):
    """40,000 draws, one per (seed, position) pair: either many seeds at one position or one
    seed over many positions. The empirical distribution must pass a chi-square test at
    level ALPHA against softmax(logits / T) and sit within TV_TOL of it in total variation."""
    n = 40_000
    rng = np.random.default_rng(0)
    if vary == "seed":
        seeds = rng.integers(0, 2**62, n).tolist()
        positions = [17] * n
    else:
        seeds = [123456789] * n
        positions = list(range(n))
    z = np.array(LOGITS) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    counts = draw_counts(LOGITS, SamplingParams(temperature=temperature), seeds, positions)
    stat = chi2(counts, probs)
    assert chi2_sf_even_df(stat, len(LOGITS) - 1) > ALPHA, (stat, counts, probs * n)
    assert 0.5 * np.abs(counts / n - probs).sum() < TV_TOL
    # The test has power: the same draws are rejected against the untempered softmax.
    if temperature != 1.0:
        plain = np.exp(np.array(LOGITS) - max(LOGITS))
        plain /= plain.sum()
        assert chi2_sf_even_df(chi2(counts, plain), len(LOGITS) - 1) < ALPHA


def test_filtered_draws_follow_the_renormalized_softmax():
    """With top_k=5 the draws follow the softmax over the 5 largest logits only."""
    n = 40_000
    seeds = np.random.default_rng(1).integers(0, 2**62, n).tolist()
    counts = draw_counts(LOGITS, SamplingParams(temperature=1.0, top_k=5), seeds, [3] * n)
    top = np.argsort(LOGITS)[::-1][:5]
    assert set(np.nonzero(counts)[0]) == set(top)
    probs = np.exp(np.array(LOGITS)[top] - max(LOGITS))
    probs /= probs.sum()
    assert chi2_sf_even_df(chi2(counts[top], probs), 4) > ALPHA


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 50, generator=gen)
    temps = [0.0, 1.0, 0.0, 2.0, 0.0, 0.7, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    params = [
        SamplingParams(
            temperature=t,
            top_k=5 if i % 3 == 0 else 0,
            top_p=0.8 if i % 4 == 1 else 1.0,
            min_p=0.1 if i == 9 else 0.0,
        )
        for i, t in enumerate(temps)
    ]
    tokens = sample(logits, tensors(params, range(12), range(12)))
    greedy = logits.argmax(dim=-1)
    for i, t in enumerate(temps):
        if t == 0.0:
            assert tokens[i] == greedy[i]
    assert (tokens != greedy).any(), "sampled rows should sometimes differ from argmax"


def test_draws_are_a_function_of_seed_and_position_only():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1)).repeat(3, 1)
    p = SamplingParams(temperature=1.0)
    a = sample(logits, tensors([p] * 3, [5, 5, 6], [9, 9, 9]))
    b = sample(logits[:1], tensors([p], [5], [9]))
    assert a[0] == a[1] == b[0]
    many = sample(logits.repeat(20, 1)[:20], tensors([p] * 20, [5] * 20, range(20)))
    assert len(set(many.tolist())) > 1  # other positions draw differently


# ---- seeded requests through the engine ----------------------------------------------------


def _prompts(n, seed=11):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


def seeded(seed, **kw):
    return SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def alone(tiny_qwen2):
    """Each of three seeded requests run on its own."""
    llm = LLM(str(tiny_qwen2))
    prompts = _prompts(3)
    params = [seeded(7), seeded(8, top_k=20), seeded(9, top_p=0.9, min_p=0.05)]
    outs = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    return llm, prompts, params, outs


def test_same_seed_same_tokens_different_seed_different(alone):
    llm, prompts, params, outs = alone
    assert llm.generate([prompts[0]], params[0])[0].token_ids == outs[0]
    other = llm.generate([prompts[0]], seeded(1234))[0].token_ids
    assert other != outs[0]
    # Two copies of one seeded request in one batch draw the same tokens.
    twins = llm.generate([prompts[0], prompts[0]], params[0])
    assert twins[0].token_ids == twins[1].token_ids == outs[0]


def test_seeded_output_independent_of_batch(alone, tiny_qwen2):
    _, prompts, params, outs = alone
    llm = LLM(str(tiny_qwen2), max_num_batched_tokens=16)  # chunked prefill as well
    fillers = _prompts(5, seed=99)
    batch = [fillers[0], prompts[0], fillers[1], prompts[1], fillers[2], prompts[2]]
    filler_params = SamplingParams(max_tokens=10, temperature=0.8)
    got = llm.generate(
        batch,
        [
            filler_params,
            params[0],
            SamplingParams(temperature=0.0, max_tokens=5),
            params[1],
            filler_params,
            params[2],
        ],
    )
    assert [got[i].token_ids for i in (1, 3, 5)] == outs


def test_seeded_output_survives_preemption(alone, tiny_qwen2):
    _, prompts, params, outs = alone
    llm = LLM(str(tiny_qwen2), page_size=4, num_kv_pages=12)  # 44 tokens for ~90 needed
    got = llm.generate(prompts * 2, params * 2)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == outs * 2


def test_greedy_requests_unchanged_by_sampled_neighbours(tiny_qwen2):
    llm = LLM(str(tiny_qwen2))
    prompts = _prompts(4, seed=5)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, greedy)]
    mixed = [greedy, seeded(1), greedy, seeded(2, top_k=3)]
    got = llm.generate(prompts, mixed)
    assert got[0].token_ids == expected[0] and got[2].token_ids == expected[2]


def test_uniforms_stay_strictly_inside_the_unit_interval():
    """A draw's extreme bits map inside (0, 1), so Gumbel noise is finite: with 24 bits the
    largest rounded to 1.0 in float32 (noise +inf: that token drawn whatever its
    probability, in ~0.8% of sampled rows of a 128k vocabulary)."""
    from specserve.layers.sampler import UNIFORM_BITS, gumbel_noise, unit_interval

    extremes = torch.tensor([0, (1 << UNIFORM_BITS) - 1])
    u = unit_interval(extremes)
    assert 0.0 < u[0] and u[1] < 1.0 and torch.isfinite(-torch.log(-torch.log(u))).all()
    wider = (torch.tensor([(1 << 24) - 1]).float() + 0.5) * (1.0 / (1 << 24))
    assert wider.item() == 1.0  # (the 24-bit draw's largest value)
    params = [SamplingParams(temperature=1.0)] * 64
    st_ = build_sampling_tensors(params, list(range(64)), [5] * 64, "cpu")
    assert torch.isfinite(gumbel_noise(st_, 4096)).all()
