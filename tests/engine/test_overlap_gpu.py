"""Overlap scheduling on CUDA, with CUDA graphs and the Triton backend: token-identical to
the synchronous loop, plain and speculative, with stops found one step late; device step
timing recorded; EAGLE-3 steps launched before the previous step's accept lengths reach
the host (chain graphs fed on the device), with random arrivals, aborts and preemption;
penalties, min_tokens and grammar masks read the step in flight before sampling. Skipped
without a GPU."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, Grammar, SamplingParams
from specserve.speculative.policy import PerRequestPolicy
from tests.support.overlap_cases import (
    StepDraftLens,
    count_gathers,
    prompts_for,
    record_drafts,
    stop_params,
)
from tests.support.tiny_models import make_random_eagle3_head, make_tiny_model

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    target = make_tiny_model(tmp_path_factory.mktemp("gpu_target"), "llama", num_layers=4)
    head = make_random_eagle3_head(tmp_path_factory.mktemp("gpu_head"), target, 200)
    return str(target), str(head)


def _run(target, prompts, params, overlap, **kw):
    llm = LLM(target, device="cuda", overlap_schedule=overlap, **kw)
    engine = llm.engine
    assert engine.runner.graphs is not None and engine.loop.overlap == (overlap == "on")
    outs = llm.generate(prompts, params)
    assert engine.kv.allocator.num_used == 0 and engine.loop.inflight is None
    return engine, [(o.token_ids, o.text, o.finish_reason) for o in outs]


SPEC = dict(speculative_num_steps=3, speculative_policy="fixed")


@pytest.mark.parametrize("mode", ["plain", "eagle3", "draft"])
def test_cuda_overlap_identical(gpu_models, mode):
    target, head = gpu_models
    kw = {
        "plain": dict(speculative_algorithm="none"),
        "eagle3": dict(speculative_algorithm="eagle3", speculative_draft_model_path=head, **SPEC),
        "draft": dict(speculative_algorithm="draft", speculative_draft_model_path=target, **SPEC),
    }[mode]
    prompts = prompts_for()
    _, sync = _run(target, prompts, GREEDY, "off", **kw)
    engine, overlap = _run(target, prompts, GREEDY, "on", **kw)
    assert overlap == sync
    times = engine.loop.times
    assert len(times.step_ms) >= engine.num_steps - 1 and len(times.gap_ms) > 0
    assert all(ms > 0 for ms in times.step_ms) and all(ms >= 0 for ms in times.gap_ms)
    assert len(times.target_ms) == len(times.step_ms)
    assert all(0 < t <= s for t, s in zip(times.target_ms, times.step_ms))


@pytest.mark.parametrize("spec", [False, True])
def test_cuda_overlap_stops_identical(gpu_models, spec):
    """fp32, so that batches of different composition (requests finishing one step late
    under overlap) cannot flip a near-tie between the two loops."""
    target, _ = gpu_models
    kw = dict(dtype="float32", max_model_len=40)
    kw.update(
        dict(speculative_algorithm="draft", speculative_draft_model_path=target, **SPEC)
        if spec
        else dict(speculative_algorithm="none")
    )
    prompts = prompts_for()
    _, ref = _run(
        target,
        prompts,
        SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
        "off",
        **kw,
    )
    params = stop_params(ref)
    _, sync = _run(target, prompts, params, "off", **kw)
    _, overlap = _run(target, prompts, params, "on", **kw)
    assert overlap == sync
    assert any(reason == "stop" for _, _, reason in sync)


def test_cuda_overlap_preemption_and_seeded(gpu_models):
    target, _ = gpu_models
    kw = dict(dtype="float32", page_size=4, num_kv_pages=40, speculative_algorithm="none")
    prompts = prompts_for()
    params = [
        SamplingParams(max_tokens=16, temperature=0.8, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    _, sync = _run(target, prompts, params, "off", **kw)
    engine, overlap = _run(target, prompts, params, "on", **kw)
    assert overlap == sync
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    "reason,shaped",
    [
        (
            "penalties",
            [
                SamplingParams(max_tokens=16, presence_penalty=1.5, frequency_penalty=0.5),
                SamplingParams(max_tokens=16, repetition_penalty=1.3, min_tokens=12),
            ],
        ),
        ("min_tokens", [SamplingParams(max_tokens=16, min_tokens=10)]),
        (
            "grammar",
            [
                SamplingParams(max_tokens=16, grammar=Grammar("json")),
                SamplingParams(max_tokens=16, grammar=Grammar("regex", r"(ab|c){1,4}-[0-9]{2,3}")),
            ],
        ),
    ],
)
def test_cuda_overlap_logit_changes_read_before_sampling(gpu_models, reason, shaped):
    """Penalties, a pending min_tokens and grammar masks under EAGLE-3 with CUDA graphs:
    steps launched before the step in flight's tokens reach the host, which those changes
    read once the step's forward is queued, draw the synchronous loop's tokens (fp32:
    requests end at different steps, so batches differ between the loops)."""
    target, head = gpu_models
    prompts = [p for p in prompts_for() for _ in shaped]
    params = shaped * len(prompts_for())
    kw = dict(dtype="float32", speculative_algorithm="eagle3", speculative_draft_model_path=head)
    _, sync = _run(target, prompts, params, "off", **kw, **SPEC)
    engine, overlap = _run(target, prompts, params, "on", **kw, **SPEC)
    assert overlap == sync
    waits = engine.stats()["loop_wait_reasons"]
    assert waits.get(f"{reason}_before_sampling", 0) > 0, waits


# fp32: the two loops pad catch-ups differently (the step in flight's rows), which in half
# precision may change GEMM rounding and flip a near tie between drafts.
EAGLE3 = dict(
    dtype="float32",
    speculative_algorithm="eagle3",
    speculative_num_steps=3,
    speculative_policy="fixed",
)


def _eagle3(gpu_models, overlap, seed=5, choices=(0, 1, 2, 3, 3), **kw):
    target, head = gpu_models
    llm = LLM(
        target,
        device="cuda",
        overlap_schedule=overlap,
        speculative_draft_model_path=head,
        **EAGLE3,
        **kw,
    )
    engine = llm.engine
    assert engine.runner.graphs is not None and engine.spec.proposer.graphs is not None
    engine.spec.policy = StepDraftLens(3, seed, choices)
    return llm


def test_cuda_eagle3_runs_ahead_same_tokens(gpu_models):
    """Simulated acceptance (partial accepts every step), one random K per step: the
    overlap loop launches speculative steps on the previous step's device results (chain
    graphs fed there) and draws the synchronous loop's tokens (up to each request's last
    few, where the host's draft-length cap is an upper bound under overlap)."""
    prompts = prompts_for()
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, seed=i)
        for i in range(len(prompts))
    ]
    outs = {}
    for overlap in ("off", "on"):
        llm = _eagle3(gpu_models, overlap, speculative_simulate_acceptance=0.6)
        graphs, chains = llm.engine.spec.proposer.graphs, []
        run_chain = graphs.run_chain
        graphs.run_chain = lambda *a, f=run_chain, c=chains: (c.append(a[2]), f(*a))[1]
        seen = count_gathers(llm)
        result = llm.generate(prompts, params)
        outs[overlap] = [o.token_ids[: 40 - 8] for o in result]
        assert (
            llm.engine.kv.allocator.num_used == 0
            and sum(o.spec_stats.accepted for o in result) > 20
        )
        assert chains
    assert outs["on"] == outs["off"]
    assert seen["moved"] > 5 and llm.engine.loop.num_waits < seen["moved"]


def test_cuda_eagle3_drafts_equal_host_chain(gpu_models):
    """Chains drafted ahead through the graphs equal the host-side chain's drafts (mixed
    draft lengths, one graph pass per draft, synchronous loop) from the same context."""
    target, _ = gpu_models
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = _eagle3(gpu_models, "off")
    pick = random.Random(2)
    ref.engine.spec.policy = PerRequestPolicy(3, lambda req: pick.choice([1, 2, 3]))
    want = record_drafts(ref)
    plain = [o.token_ids for o in ref.generate(prompts_for(), params)]
    llm = _eagle3(gpu_models, "on", choices=(0, 1, 2, 3))
    got = record_drafts(llm)
    seen = count_gathers(llm)
    assert [o.token_ids for o in llm.generate(prompts_for(), params)] == plain
    common = got.keys() & want.keys()
    assert len(common) > 20 and seen["drafted_ahead"] > 5
    assert {key: got[key] for key in common} == {key: want[key] for key in common}


def test_cuda_eagle3_arrivals_aborts_and_preemption(gpu_models):
    """Random arrivals and aborts (often in flight) with a small KV cache and random K per
    step: requests not aborted produce the synchronous loop's tokens; no page is left."""
    target, _ = gpu_models
    prompts = prompts_for(seed=8, lengths=(3, 12, 7, 20, 5, 16, 9, 2, 14, 6))
    kw = dict(page_size=4, num_kv_pages=18, max_model_len=64)
    _, ref = _run(
        target,
        prompts_for(),
        SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
        "off",
        dtype="float32",
        speculative_algorithm="none",
    )
    params = stop_params(ref)
    params = [params[i % len(params)] for i in range(len(prompts))]
    _, expected = _run(
        target, prompts, params, "off", dtype="float32", speculative_algorithm="none", **kw
    )
    llm = _eagle3(gpu_models, "on", **kw)
    seen = count_gathers(llm)
    engine, rng = llm.engine, random.Random(21)
    pending, ids, finished, aborted = list(range(len(prompts))), {}, {}, set()
    while pending or engine.has_unfinished():
        while pending and rng.random() < 0.5:
            i = pending.pop(0)
            ids[engine.add_request(prompts[i], params[i])] = i
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = (out.token_ids, out.text, out.finish_reason)
        live = [rid for rid in engine.requests if rid not in aborted]
        if live and rng.random() < 0.08:
            victim = rng.choice(live)
            engine.abort_request(victim)
            aborted.add(victim)
    assert engine.kv.allocator.num_used == 0 and not engine.requests
    assert engine.scheduler.num_preemptions > 0 and seen["moved"] > 0
    for rid, i in ids.items():
        if rid not in aborted:
            assert finished[rid] == expected[i]


def test_cuda_goodput_prices_the_context(gpu_models):
    """On a GPU the goodput policy's cost model prices decode attention by context (the
    KV's bytes per token over the device's bandwidth, StepCostModel.context_ms_per_token),
    and the tokens stay those of plain decoding."""
    target, head = gpu_models
    kw = dict(speculative_algorithm="eagle3", speculative_draft_model_path=head)
    prompts = prompts_for()
    _, plain = _run(target, prompts, GREEDY, "on", speculative_algorithm="none")
    engine, goodput = _run(target, prompts, GREEDY, "on", speculative_policy="goodput", **kw)
    assert goodput == plain
    cost = engine.spec.cost
    assert cost.context_ms_per_token > 0 and cost.context_ms(1000) > 0
