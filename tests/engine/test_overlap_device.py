"""Speculative steps launched before the previous step's accept lengths reach the host
(overlap loop, EAGLE-3, greedy, one draft length per step): committed lengths, the drafter's
catch-up and the verify step's inputs are computed on the device from the step in flight.

- With simulated acceptance (partial accepts every step) and the same draft length per step
  in both loops, the tokens equal the synchronous loop's: the shifts, the catch-up's drafting
  row and the drafts must all be right for that.
- With real verification, each draft chain equals what the host-side chain (the one mixed
  draft lengths use) drafts from the same committed context.
- Outputs equal plain decoding with stops mid-draft and one step late, max_tokens, the
  context limit, aborts in flight, preemption and random arrivals; no page is left.
Each runs eagerly and through the graph runners' padded paths (eager on the CPU).
"""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from specserve.speculative.eagle3 import capture_drafter_graphs
from specserve.speculative.policy import PerRequestPolicy
from tests.support.model_cases import install_padded_runner
from tests.support.overlap_cases import (
    GREEDY,
    StepDraftLens,
    churn,
    count_gathers,
    make_models,
    make_reference,
    prompts_for,
    record_drafts,
    spec_kwargs,
    stop_params,
)
from tests.support.spies import spy_on


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(models):
    return make_reference(models)


def eagle3(models, overlap: str, padded=False, seed=5, choices=(0, 1, 2, 3, 3), **kw):
    """An EAGLE-3 engine whose policy draws one draft length per step (0 included)."""
    kw = {"speculative_num_steps": 3, **spec_kwargs(models, "eagle3"), **kw}
    llm = LLM(models["target"], overlap_schedule=overlap, **kw)
    llm.engine.spec.policy = StepDraftLens(3, seed, choices)
    if padded:
        install_padded_runner(llm, q_lens=(1, 2, 3, 4), aux_layer_ids=llm.engine.spec.aux_layer_ids)
        proposer = llm.engine.spec.proposer
        proposer.graphs = capture_drafter_graphs(proposer, llm.engine.target, use_graphs=False)
    return llm


def ran_ahead(llm, seen) -> None:
    """Most steps after a speculative one were launched without waiting for it."""
    assert seen["moved"] > 0 and seen["drafted_ahead"] > 0
    assert llm.engine.loop.num_waits < seen["moved"]


@pytest.mark.parametrize(
    "padded, kw, sampled",
    [
        (False, {}, False),
        (False, dict(page_size=1), False),
        (True, dict(page_size=4), False),
        (False, {}, True),
    ],
)
def test_simulated_acceptance_same_tokens(models, padded, kw, sampled):
    """Partial acceptance every step: positions, KV slots and the drafter's inputs move by
    accept lengths only the device knows. Tokens equal the synchronous loop's, up to the
    last few of each request (where the host's draft-length cap, an upper bound under
    overlap, may differ). `sampled`: one request samples, so steps that draft wait (its
    drafts are drawn on the host) and plain ones after a speculative step run ahead with
    its sampling counters moved on the device."""
    prompts = prompts_for()
    params = [
        SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True, seed=i)
        for i in range(len(prompts))
    ]
    if sampled:
        params[2] = SamplingParams(max_tokens=36, temperature=0.8, seed=2, ignore_eos=True)
    outs, accepted = {}, {}
    for overlap in ("off", "on"):
        llm = eagle3(models, overlap, padded, speculative_simulate_acceptance=0.6, **kw)
        seen = count_gathers(llm)
        result = llm.generate(prompts, params)
        outs[overlap] = [o.token_ids[: 36 - 8] for o in result]
        accepted[overlap] = sum(o.spec_stats.accepted for o in result)
        assert llm.engine.kv.allocator.num_used == 0
    if sampled:
        assert seen["moved"] > 0 and llm.engine.loop.num_waits > 0
    else:
        ran_ahead(llm, seen)
    assert outs["on"] == outs["off"]
    assert accepted["on"] > 20 and accepted["off"] > 20


@pytest.mark.parametrize("padded", [False, True])
def test_drafts_equal_host_chain(models, reference, padded):
    """Each chain drafted ahead (catch-up padded with the step in flight's rows, drafting
    row and positions on the device) equals the chain the host-side path drafts from the
    same committed context (mixed draft lengths per request, synchronous loop)."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref_llm = LLM(models["target"], speculative_num_steps=3, **spec_kwargs(models, "eagle3"))
    pick = random.Random(2)
    ref_llm.engine.spec.policy = PerRequestPolicy(3, lambda req: pick.choice([1, 2, 3]))
    want = record_drafts(ref_llm)
    ref_llm.generate(prompts_for(), params)
    matched = 0
    for seed in (5, 6):
        llm = eagle3(
            models, "on", padded, seed=seed, choices=(0, 1, 2, 3), page_size=4 if padded else 16
        )
        seen = count_gathers(llm)
        got = record_drafts(llm)
        outs = llm.generate(prompts_for(), params)
        assert [o.token_ids for o in outs] == [t for t, _, _ in reference(params)]
        ran_ahead(llm, seen)
        common = got.keys() & want.keys()
        assert {key: got[key] for key in common} == {key: want[key] for key in common}
        matched += len(common)
    assert matched > 40


@pytest.mark.parametrize("padded", [False, True])
def test_stops_max_tokens_and_context_limit(models, reference, padded):
    """Stop tokens and strings mid-draft, found one step late with the next step already
    drafted and launched; max_tokens; the context limit (no position past it, even for
    drafts that may be accepted)."""
    params = stop_params(reference(GREEDY))
    expected = reference(params, max_model_len=40)
    llm = eagle3(models, "on", padded, max_model_len=40, page_size=4)
    seen = count_gathers(llm)
    outs = llm.generate(prompts_for(), params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == expected
    ran_ahead(llm, seen)
    assert llm.engine.kv.allocator.num_used == 0 and not llm.engine.requests


@pytest.mark.parametrize("padded", [False, True])
def test_arrivals_aborts_and_preemption(models, reference, padded):
    """Requests arrive and are aborted at random turns, often while their step is in
    flight, with a small KV cache (preemption): every request not aborted produces the
    tokens of plain decoding, and no page is left."""
    prompts = prompts_for(seed=8, lengths=(3, 12, 7, 20, 5, 16, 9, 2, 14, 6))
    params = stop_params(reference(GREEDY))
    params = [params[i % len(params)] for i in range(len(prompts))]
    expected = reference(params, prompts)
    llm = eagle3(models, "on", padded, page_size=4, num_kv_pages=18)
    seen = count_gathers(llm)
    engine = llm.engine
    ids, finished, aborted, in_flight_aborts = churn(engine, prompts, params, arrive_p=0.5)
    assert engine.kv.allocator.num_used == 0 and not engine.requests
    assert in_flight_aborts and engine.scheduler.num_preemptions > 0
    ran_ahead(llm, seen)
    for rid, i in ids.items():
        if rid not in aborted:
            assert finished[rid] == expected[i]


@pytest.mark.parametrize("padded", [False, True])
def test_chunked_prefill_features_in_flight(models, reference, padded):
    """A prefill chunk that stops one token short of the prompt's end draws no token, yet
    its features are in flight when the next step (its first decode, drafting) is launched
    ahead: the drafter's catch-up takes them from the step in flight."""
    # step 1: the first prompt (5) and 23 of the second's 24 tokens fill the budget of 28;
    # step 2 decodes both, drafting (drafts take the budget prefill leaves)
    prompts = prompts_for(lengths=(5, 24))
    llm = eagle3(models, "on", padded, page_size=4, max_num_batched_tokens=28, choices=(3,))
    seen = count_gathers(llm)
    proposer, short_chunks = llm.engine.spec.proposer, []
    catch_up_inputs = proposer._catch_up_inputs

    def spy(items, prev):
        if prev is not None:
            short_chunks.extend(
                it
                for it in items
                if id(it.request) in {id(s.request) for s in prev.scheduled}
                and id(it.request) not in prev.rows
            )
        return catch_up_inputs(items, prev)

    spy_on(proposer, "_catch_up_inputs", spy)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [t for t, _, _ in reference(GREEDY, prompts)]
    assert short_chunks
    ran_ahead(llm, seen)


def test_waiting_path_drops_requests_that_stopped(models, reference):
    """When the loop does wait for the previous step (a draft model proposes on the host),
    a request whose tokens end it at a stop token or EOS is not drafted and verified again
    in the next step."""
    params = stop_params(reference(GREEDY))
    expected = reference(params)
    llm = LLM(
        models["target"],
        overlap_schedule="on",
        speculative_num_steps=3,
        **spec_kwargs(models, "random"),
    )
    runner, stopped = llm.engine.runner, []
    prepare = runner.prepare

    def spy(batch, prev=None, *rest):
        for s in batch:
            req = s.request
            p = req.params
            stopped.extend(
                t
                for t in req.unprocessed_token_ids
                if t in p.stop_token_ids or (not p.ignore_eos and t in req.eos_token_ids)
            )
        return prepare(batch, prev, *rest)

    spy_on(runner, "prepare", spy)
    outs = llm.generate(prompts_for(), params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == expected
    assert llm.engine.loop.num_waits > 0 and stopped == []
    assert sum(r == "stop" for _, _, r in expected) >= 2
