"""The CUDA-graph path's padding, run eagerly on the CPU: decode and verify steps with mixed
draft lengths are padded to one length per request and to a batch bucket, and greedy output
stays identical to plain decoding."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from specserve.speculative.policy import PerRequestPolicy
from tests.support.model_cases import install_padded_runner
from tests.support.spies import spy_on
from tests.support.tiny_models import VOCAB


@pytest.mark.parametrize("budget", [2048, 12])
def test_padded_graph_steps_keep_greedy_output(tiny_llama, budget):
    """Decode and verify steps through the padded graph path, and (a 12-token budget: the
    prompts in chunks beside verify rows) steps mixing prefill chunks with them through the
    mixed graphs' path."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 9, 14, 30, 5)]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(tiny_llama)).generate(prompts, params)]

    llm = LLM(
        str(tiny_llama),
        speculative_algorithm="draft",
        speculative_draft_model_path=str(tiny_llama),
        speculative_num_steps=4,
        speculative_policy="fixed",
        page_size=4,
        max_num_batched_tokens=budget,
    )
    calls = install_padded_runner(llm, q_lens=(1, 2, 3, 4, 5))
    pick = random.Random(9)
    llm.engine.spec.policy = PerRequestPolicy(4, lambda req: pick.choice([0, 1, 2, 4]))
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert calls["graph"] > 5  # decode/verify steps went through the padded graph path
    assert calls["mixed"] >= (1 if budget > 60 else 5)  # and steps carrying prefill
    assert llm.engine.kv.allocator.num_used == 0


def _run_engine(llm, prompts, params) -> dict:
    """Every request's (tokens, logprobs) run through `llm`'s engine step by step."""
    engine = llm.engine
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    tokens, logprobs = {i: [] for i in ids}, {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = list(out.token_ids)
            logprobs[out.request_id] += out.new_logprobs
    return {i: (tokens[i], logprobs[i]) for i in ids}


def test_graph_head_serves_greedy_sampled_and_logprob_steps(tiny_llama):
    """The graphs' in-graph logits and greedy tokens (engine: `logits_head`) serve greedy,
    seeded sampled and logprob requests exactly as logits projected after the step do; the
    greedy-only steps take the graph's tokens."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 7, 12, 4)]
    params = [
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
    ]
    plain = _run_engine(LLM(str(tiny_llama), page_size=4), prompts, params)
    llm = LLM(str(tiny_llama), page_size=4)
    calls = install_padded_runner(llm, q_lens=(1,))
    heads = []
    sample = llm.engine.runner.sample_async

    def watched(step, hidden, *args):
        heads.append(llm.engine.runner.step_head is not None)
        return sample(step, hidden, *args)

    spy_on(llm.engine.runner, "sample_async", watched)
    padded = _run_engine(llm, prompts, params)
    for (tokens, lps), (ref_tokens, ref_lps) in zip(padded.values(), plain.values()):
        assert tokens == ref_tokens and len(lps) == len(ref_lps)
        for lp, ref in zip(lps, ref_lps):  # the padded batch's projection rounds alike
            assert [t for t, _ in lp.top] == [t for t, _ in ref.top]
            assert lp.logprob == pytest.approx(ref.logprob, abs=1e-5)
    assert len(plain[list(plain)[2]][1]) == 9
    assert calls["graph"] > 5 and sum(heads) == calls["graph"]
    from specserve.runtime import model_runner

    kept = model_runner.argmax_rows

    def no_argmax(x):  # prefill steps (no graph) take theirs
        assert llm.engine.runner.step_head is None, "a graph step launched an argmax after it"
        return kept(x)

    model_runner.argmax_rows = no_argmax
    before = calls["graph"]
    try:  # greedy-only steps take the graph's tokens; the cost model's timed step too
        greedy = _run_engine(llm, prompts[::3], params[::3])
        llm.engine.runner.time_forward(3)
    finally:
        model_runner.argmax_rows = kept
    assert calls["graph"] > before + 5
    assert [t for t, _ in greedy.values()] == [plain[i][0] for i in list(plain)[::3]]


@pytest.mark.parametrize("drafter", ["target", "other"])
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_dense_greedy_verify_takes_the_graphs_tokens(tiny_llama, tmp_path, drafter, overlap):
    """A greedy verify step whose rows are all the graph's rows (every request drafting K)
    takes the argmaxes and accept lengths the graph took with the logits, launching no
    argmax or verification of its own, and the output stays plain decoding's: with the
    target as its own drafter (every draft accepted) and with another model (most
    rejected), in the synchronous loop and under overlap (drafts left on the device)."""
    from specserve.runtime import model_runner, verify
    from tests.support.tiny_models import make_tiny_model

    rng = random.Random(6)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (4, 11, 6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(tiny_llama)).generate(prompts, params)]
    draft = tiny_llama if drafter == "target" else make_tiny_model(tmp_path, "llama", seed=1)
    llm = LLM(
        str(tiny_llama),
        speculative_algorithm="draft",
        speculative_draft_model_path=str(draft),
        speculative_num_steps=3,
        speculative_policy="fixed",
        page_size=4,
        overlap_schedule=overlap,
    )
    calls = install_padded_runner(llm, q_lens=(1, 2, 3, 4))
    runner = llm.engine.runner
    sample, kept = runner.sample_async, verify.argmax_rows
    seen = {"dense": [], "in_dense": False}

    def watched(step, hidden, *args):
        draft_lens = [s.drafted for s in step.sampled]
        dense = (
            runner.step_head is not None
            and draft_lens
            and min(draft_lens) == max(draft_lens) > 0
            and len(step.sample_rows) == hidden.shape[0]
        )
        seen["in_dense"] = dense
        try:
            out = sample(step, hidden, *args)
        finally:
            seen["in_dense"] = False
        if dense:
            seen["dense"] += out.accept_len.tolist()
        return out

    def argmax(x):
        assert not seen["in_dense"], "a dense greedy verify step launched its own argmax"
        return kept(x)

    verify_greedy = model_runner.verify_greedy

    def verified(*args):
        assert not seen["in_dense"], "a dense greedy verify step verified on its own"
        return verify_greedy(*args)

    spy_on(runner, "sample_async", watched)
    verify.argmax_rows = argmax
    model_runner.verify_greedy = verified
    try:
        outs = llm.generate(prompts, params)
    finally:
        verify.argmax_rows, model_runner.verify_greedy = kept, verify_greedy
    assert [o.token_ids for o in outs] == plain
    assert len(seen["dense"]) >= 9 and calls["graph"] > 5
    if drafter == "target":
        assert min(seen["dense"]) == 3
    else:
        assert min(seen["dense"]) == 0


def test_graph_accept_lengths_are_greedy_verifications():
    """The accept lengths a verify graph takes (`greedy_accept_lens`) are verify_greedy's for
    every request drafting q - 1, on random ids and argmaxes with many matches."""
    import torch

    from specserve.runtime.verify import greedy_accept_lens, verify_greedy

    gen = torch.Generator().manual_seed(3)
    for q in (2, 4, 6):
        choice = torch.randint(0, 3, (64, q), generator=gen)
        logits = torch.nn.functional.one_hot(choice, 5).float()
        drafts = torch.where(
            torch.rand(64, q - 1, generator=gen) < 0.8,
            choice[:, :-1],
            torch.randint(0, 3, (64, q - 1), generator=gen),
        )
        ids = torch.cat([torch.zeros(64, 1, dtype=torch.int64), drafts], dim=1)
        ref = verify_greedy(logits, drafts, None)
        assert torch.equal(greedy_accept_lens(ids, choice), ref.accept_len)
        assert torch.equal(ref.tokens, choice) and ref.accept_len.max() == q - 1
