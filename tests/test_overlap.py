"""Overlap scheduling (engine/step_loop.py) changes no output: token-identical to the
synchronous loop for greedy and seeded sampling, with and without speculation (random
per-step draft lengths), stops landing mid-draft and mid-batch, max_tokens, aborts while a
step is in flight, forced preemption; and no KV page is left behind."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.errors import ConfigError
from specserve.spec.policy import PerRequestPolicy
from tests.tiny_models import VOCAB, make_random_eagle3_head, make_tiny_model

GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


def _prompts(seed=3, lengths=(1, 4, 9, 16, 17, 23, 31, 6)):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]
    prompts[1] = [7, 8, 9, 10] * 6  # something for n-gram lookup to find
    return prompts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = make_tiny_model(tmp_path_factory.mktemp("ov_target"), "llama", num_layers=4)
    other = make_tiny_model(tmp_path_factory.mktemp("ov_draft"), "llama", seed=7, num_layers=1)
    head = make_random_eagle3_head(tmp_path_factory.mktemp("ov_head"), target, 200)
    return {"target": str(target), "copy": str(target), "random": str(other), "eagle3": str(head)}


def _spec_kwargs(models, drafter: str | None) -> dict:
    if drafter is None:
        return {}
    if drafter == "ngram":
        return dict(speculative_algorithm="ngram", speculative_policy="fixed")
    algo = "eagle3" if drafter == "eagle3" else "draft"
    return dict(speculative_algorithm=algo, speculative_draft_model_path=models[drafter],
                speculative_policy="fixed")


def _random_draft_lens(llm, seed=11):
    rng = random.Random(seed)
    k_max = llm.engine.spec.k_max
    llm.engine.spec.policy = PerRequestPolicy(k_max, lambda req: rng.choice([0, 0, 1, 2, k_max]))


def _count_gathers(llm) -> dict:
    """Counts steps prepared while the previous step's tokens were still on the device."""
    runner, seen = llm.engine.runner, {"gathered": 0, "steps": 0}
    prepare = runner.prepare

    def spy(batch, prev=None):
        seen["steps"] += 1
        seen["gathered"] += prev is not None
        return prepare(batch, prev)

    runner.prepare = spy
    sched, schedule = llm.engine.scheduler, llm.engine.scheduler.schedule

    def check(policy=None):
        # A request whose in-flight tokens end it (max_tokens, context) is not scheduled
        # again, so no step writes past the context limit.
        batch = schedule(policy)
        kv, spec = llm.engine.kv, llm.engine.spec
        lookahead = spec.k_max + 1 if spec else 1
        for s in batch:
            req = s.request
            assert req.num_left > 0
            assert req.cached_len + s.num_tokens + s.draft_len <= llm.engine.max_model_len
            # KV lookahead: at most twice a step's worth past what is committed.
            assert len(req.page_table) <= kv.pages_needed(req.committed_len + 2 * lookahead)
        return batch

    sched.schedule = check
    return seen


def _generate(models, prompts, params, overlap: str, drafter=None, random_k=False, **kw):
    llm = LLM(models["target"], overlap_schedule=overlap, **_spec_kwargs(models, drafter), **kw)
    assert llm.engine.loop.overlap == (overlap == "on")
    if random_k:
        _random_draft_lens(llm)
    seen = _count_gathers(llm)
    outs = llm.generate(prompts, params)
    engine = llm.engine
    assert engine.kv.allocator.num_used == 0 and not engine.has_unfinished()
    assert engine.loop.inflight is None and not engine.requests
    if engine.spec is not None:
        assert engine.spec.acceptance._per_request == {}  # nothing left behind either
    if overlap == "on" and not drafter:
        assert seen["gathered"] > seen["steps"] // 2  # plain steps really ran ahead
    return llm, [(o.token_ids, o.text, o.finish_reason) for o in outs]


@pytest.fixture(scope="module")
def reference(models):
    """The synchronous loop without speculation, per parameter set."""
    cache = {}

    def get(params, prompts=None, **kw):
        key = (repr(params), repr(prompts), repr(sorted(kw.items())))
        if key not in cache:
            cache[key] = _generate(models, prompts or _prompts(), params, "off", **kw)[1]
        return cache[key]

    return get


@pytest.mark.parametrize("kw", [{}, dict(page_size=1), dict(page_size=4,
                                                             max_num_batched_tokens=9)])
def test_plain_greedy_identical(models, reference, kw):
    _, outs = _generate(models, _prompts(), GREEDY, "on", **kw)
    assert outs == reference(GREEDY)


@pytest.mark.parametrize("drafter", ["copy", "random", "ngram", "eagle3"])
def test_speculative_greedy_identical_random_draft_lengths(models, reference, drafter):
    llm, outs = _generate(models, _prompts(), GREEDY, "on", drafter, random_k=True,
                          speculative_num_steps=4)
    assert outs == reference(GREEDY)
    assert sum(k * n for k, n in enumerate(llm.engine.spec.policy.trace.steps_by_draft_len))


def _stop_params(ref):
    """Stop tokens and stop strings taken from the reference outputs so that they land
    inside the generation (mid-draft under speculation), plus a spread of max_tokens."""
    (t0, _, _), (_, text2, _), (t5, _, _) = ref[0], ref[2], ref[5]
    stop_string = text2[3:6] if len(text2) >= 6 else text2
    return [
        SamplingParams(max_tokens=14, temperature=0.0, stop_token_ids=[t0[4]]),
        SamplingParams(max_tokens=14, temperature=0.0, stop_token_ids=[t5[2], t5[9]]),
        SamplingParams(max_tokens=14, temperature=0.0, stop=[stop_string]),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.0, stop=[stop_string], stop_token_ids=[2]),
        SamplingParams(max_tokens=5, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),  # context limit
    ]


@pytest.mark.parametrize("drafter", [None, "copy", "eagle3"])
def test_stops_and_max_tokens_identical(models, reference, drafter):
    params = _stop_params(reference(GREEDY))
    expected = reference(params, max_model_len=40)
    assert [len(t) for t, _, _ in expected][3:5] == [1, 2]
    assert any(r == "stop" for _, _, r in expected)
    assert len(expected[7][0]) == 40 - len(_prompts()[7])  # stopped by the context limit
    _, outs = _generate(models, _prompts(), params, "on", drafter, speculative_num_steps=7,
                        max_model_len=40)
    assert outs == expected


@pytest.mark.parametrize("drafter", [None, "random", "eagle3"])
def test_preemption_identical(models, reference, drafter):
    kw = dict(page_size=4, num_kv_pages=24)
    llm, outs = _generate(models, _prompts(), GREEDY, "on", drafter, random_k=bool(drafter),
                          speculative_num_steps=3, **kw)
    assert outs == reference(GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0


def _run_engine(engine, prompts, params) -> dict:
    """Step by hand: each request's tokens and the logprobs its outputs carried."""
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    tokens, logprobs = {}, {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.num_new_tokens == len(out.new_logprobs) or not out.new_logprobs
            logprobs[out.request_id] += [(lp.logprob, lp.top) for lp in out.new_logprobs]
            tokens[out.request_id] = list(out.token_ids)
    assert engine.kv.allocator.num_used == 0
    return [(tokens[rid], logprobs[rid]) for rid in ids]


@pytest.mark.parametrize("drafter", [None, "random"])
def test_seeded_sampling_and_logprobs_identical(models, drafter):
    prompts = _prompts()
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=100 + i,
                             logprobs=2, ignore_eos=True) for i in range(len(prompts))]
    params[3] = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
    params[4] = SamplingParams(max_tokens=12, temperature=0.7, seed=5, ignore_eos=True)
    results = {}
    for overlap in ("off", "on"):
        llm = LLM(models["target"], overlap_schedule=overlap, **_spec_kwargs(models, drafter))
        results[overlap] = _run_engine(llm.engine, prompts, params)
    assert results["on"] == results["off"]
    assert all(len(lps) == 12 for i, (_, lps) in enumerate(results["on"]) if i != 4)


def test_abort_while_in_flight(models, reference):
    """Aborting requests whose step is in flight drops their tokens and returns their pages;
    the others are unaffected."""
    for drafter in (None, "copy"):
        llm = LLM(models["target"], overlap_schedule="on", **_spec_kwargs(models, drafter))
        engine = llm.engine
        prompts = _prompts()
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        finished, aborted = {}, set()
        for turn in range(60):
            for out in engine.step():
                assert out.request_id not in aborted
                if out.finished:
                    finished[out.request_id] = out.token_ids
            inflight = engine.loop.inflight
            if turn in (2, 3) and inflight is not None:
                victim = next(s.request.request_id for s in inflight.step_input.sampled
                              if s.request.request_id not in aborted)
                engine.abort_request(victim)
                aborted.add(victim)
            if not engine.has_unfinished():
                break
        assert len(aborted) == 2 and not engine.has_unfinished()
        assert engine.kv.allocator.num_used == 0
        expected = reference(GREEDY)
        for rid, (tokens, _, _) in zip(ids, expected):
            if rid not in aborted:
                assert finished[rid] == tokens


def test_config_flags():
    assert EngineConfig(model="x", device="cpu").overlap_enabled() is False
    assert EngineConfig(model="x", device="cpu", overlap_schedule="on").overlap_enabled()
    assert not EngineConfig(model="x", device="cuda", disable_overlap_schedule=True,
                            speculative_algorithm="none").overlap_enabled()
    assert EngineConfig(model="x", device="cuda", speculative_algorithm="none").overlap_enabled()
    with pytest.raises(ConfigError, match="overlap_schedule"):
        EngineConfig(model="x", overlap_schedule="sometimes")
    with pytest.raises(ConfigError, match="contradicts"):
        EngineConfig(model="x", overlap_schedule="on", disable_overlap_schedule=True)
    import argparse

    from specserve.cli import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--disable-overlap-schedule", "--device", "cuda"])
    assert engine_config(args).overlap_enabled() is False


def test_overlap_does_the_same_work(models):
    """Accepted drafts count as cached in both loops (nothing recomputed), and with a
    drafter that is always right both loops run the same steps and accept every draft."""
    results = {}
    for overlap in ("off", "on"):
        llm = LLM(models["target"], overlap_schedule=overlap, **_spec_kwargs(models, "copy"),
                  speculative_num_steps=3)
        fed = []
        schedule = llm.engine.scheduler.schedule

        def spy(policy=None, schedule=schedule, fed=fed):
            batch = schedule(policy)
            fed.append(sum(s.num_tokens for s in batch))
            # Once generating, a request feeds only its newest token (its accepted drafts
            # are cached already): nothing is recomputed.
            assert all(s.num_tokens == 1 for s in batch if s.request.num_generated > 0)
            return batch

        llm.engine.scheduler.schedule = spy
        outs = llm.generate(_prompts(), GREEDY)
        stats = [(o.spec_stats.drafted, o.spec_stats.accepted) for o in outs]
        results[overlap] = (llm.engine.num_steps, sum(fed), stats)
        assert all(d == a > 0 for d, a in stats)
    assert results["on"] == results["off"]


def test_server_engine_loop_with_overlap(models, reference):
    """The server's engine process loop (engine.step() per turn) under overlap: the deltas
    add up to the synchronous outputs, an abort mid-stream frees everything."""
    import multiprocessing as mp
    import queue

    from specserve.server.engine_proc import AddRequest, EngineLoop, Outbox, OutputDelta

    llm = LLM(models["target"], overlap_schedule="on")
    engine = llm.engine
    inbox: queue.Queue = queue.Queue()
    reader, writer = mp.Pipe(duplex=False)
    outbox = Outbox(writer)
    prompts = _prompts()
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    inbox.put(("add", [AddRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
               + [AddRequest("long", prompts[0], long)]))
    loop = EngineLoop(engine, inbox, outbox)
    tokens: dict[str, list[int]] = {}
    done: set[str] = set()
    while len(done) < len(prompts):
        loop._drain(block=False)
        loop._step()
        loop._send()
        kind, report = reader.recv()
        for delta in (OutputDelta(*t) for t in report.outputs):
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finished:
                done.add(delta.request_id)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == [t for t, _, _ in
                                                              reference(GREEDY)]
    assert "long" not in done and engine.stats()["overlap_schedule"] is True
    inbox.put(("abort", ["long"]))
    inbox.put(("shutdown", None))
    loop.run()
    while reader.recv()[0] != "stopped":
        pass
    assert engine.kv.allocator.num_used == 0
    outbox.close()


@pytest.mark.parametrize("drafter", [None, "eagle3"])
def test_graph_padded_steps_identical(models, reference, drafter):
    """Through the CUDA graph runner's padded static buffers (eagerly, on the CPU): padded
    decode steps whose input ids are gathered from the step in flight."""
    from specserve.runtime.cuda_graphs import CudaGraphRunner

    llm = LLM(models["target"], overlap_schedule="on", page_size=4,
              **_spec_kwargs(models, drafter))
    runner, spec = llm.engine.runner, llm.engine.spec
    graphs = CudaGraphRunner(runner.model, runner.kv.layers, runner.backend, (1, 2, 4, 8),
                             tokens_per_request=(1, 2, 3, 4), max_seq_len=512,
                             aux_layer_ids=spec.aux_layer_ids if spec else (),
                             use_graphs=False)
    graphs.capture()
    runner.graphs = graphs
    calls = {"graph": 0}
    run = graphs.run

    def counting_run(*args):
        calls["graph"] += 1
        return run(*args)

    graphs.run = counting_run
    if drafter:
        _random_draft_lens(llm, seed=4)
    seen = _count_gathers(llm)
    outs = llm.generate(_prompts(), GREEDY)
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == reference(GREEDY)
    assert calls["graph"] > 5 and (drafter or seen["gathered"] > 0)
    assert llm.engine.kv.allocator.num_used == 0


@pytest.mark.parametrize("drafter", [None, "random", "eagle3"])
def test_random_arrivals_aborts_and_preemption(models, reference, drafter):
    """Requests arrive and are aborted at random turns (often while their step is in
    flight) with a small KV cache and random draft lengths: every request that is not
    aborted produces exactly the tokens of the synchronous loop, and no page is left."""
    prompts = _prompts(seed=8, lengths=(3, 12, 7, 20, 5, 16, 9, 2, 14, 6))
    params = _stop_params(reference(GREEDY))
    params = [params[i % len(params)] for i in range(len(prompts))]
    expected = reference(params, prompts)
    rng = random.Random(21)
    llm = LLM(models["target"], overlap_schedule="on", page_size=4, num_kv_pages=20,
              speculative_num_steps=3, **_spec_kwargs(models, drafter))
    if drafter:
        _random_draft_lens(llm, seed=22)
    engine = llm.engine
    pending = list(range(len(prompts)))
    ids, finished, aborted, in_flight_aborts = {}, {}, set(), 0
    while pending or engine.has_unfinished():
        while pending and rng.random() < 0.6:
            i = pending.pop(0)
            ids[engine.add_request(prompts[i], params[i])] = i
        for out in engine.step():
            assert out.request_id not in aborted
            if out.finished:
                finished[out.request_id] = (out.token_ids, out.text, out.finish_reason)
        live = [rid for rid in engine.requests if rid not in aborted]
        if live and rng.random() < 0.08:
            victim = rng.choice(live)
            inflight = engine.loop.inflight
            in_flight_aborts += inflight is not None and any(
                s.request.request_id == victim for s in inflight.step_input.sampled)
            engine.abort_request(victim)
            aborted.add(victim)
    assert engine.kv.allocator.num_used == 0 and not engine.requests
    assert in_flight_aborts and engine.scheduler.num_preemptions > 0
    assert len(finished) + len(aborted) == len(prompts)
    for rid, i in ids.items():
        if rid not in aborted:
            assert finished[rid] == expected[i]
