"""Overlap scheduling under request churn: aborts while a step is in flight, random
arrivals and aborts with preemption, and the server's engine process loop."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from tests.support.overlap_cases import (
    GREEDY,
    churn,
    make_models,
    make_reference,
    prompts_for,
    random_draft_lens,
    spec_kwargs,
    stop_params,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(models):
    return make_reference(models)


def test_abort_while_in_flight(models, reference):
    """Aborting requests whose step is in flight drops their tokens and returns their pages;
    the others are unaffected."""
    for drafter in (None, "copy"):
        llm = LLM(models["target"], overlap_schedule="on", **spec_kwargs(models, drafter))
        engine = llm.engine
        prompts = prompts_for()
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        finished, aborted = {}, set()
        for turn in range(60):
            for out in engine.step():
                assert out.request_id not in aborted
                if out.finished:
                    finished[out.request_id] = out.token_ids
            inflight = engine.loop.inflight
            if turn in (2, 3) and inflight is not None:
                victim = next(
                    s.request.request_id
                    for s in inflight.step_input.sampled
                    if s.request.request_id not in aborted
                )
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


def test_server_engine_loop_with_overlap(models, reference):
    """The server's engine process loop (engine.step() per turn) under overlap: the deltas
    add up to the synchronous outputs, an abort mid-stream frees everything."""
    import multiprocessing as mp
    import queue

    from specserve.server.engine_proc import EngineLoop, Outbox
    from specserve.server.messages import (
        AbortRequests,
        AddRequest,
        AddRequests,
        OutputDelta,
        Shutdown,
        Stopped,
    )

    llm = LLM(models["target"], overlap_schedule="on")
    engine = llm.engine
    inbox: queue.Queue = queue.Queue()
    reader, writer = mp.Pipe(duplex=False)
    outbox = Outbox(writer)
    prompts = prompts_for()
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    inbox.put(
        AddRequests(
            [AddRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
            + [AddRequest("long", prompts[0], long)]
        )
    )
    loop = EngineLoop(engine, inbox, outbox)
    tokens: dict[str, list[int]] = {}
    done: set[str] = set()
    while len(done) < len(prompts):
        loop._drain(block=False)
        loop._step()
        loop._send()
        report = reader.recv()
        for delta in (OutputDelta(*t) for t in report.outputs):
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finished:
                done.add(delta.request_id)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == [t for t, _, _ in reference(GREEDY)]
    assert "long" not in done and engine.stats()["overlap_schedule"] is True
    inbox.put(AbortRequests(["long"]))
    inbox.put(Shutdown())
    loop.run()
    while not isinstance(reader.recv(), Stopped):
        pass
    assert engine.kv.allocator.num_used == 0
    outbox.close()


@pytest.mark.parametrize("drafter", [None, "random", "eagle3"])
def test_random_arrivals_aborts_and_preemption(models, reference, drafter):
    """Requests arrive and are aborted at random turns (often while their step is in
    flight) with a small KV cache and random draft lengths: every request that is not
    aborted produces exactly the tokens of the synchronous loop, and no page is left. Most
    prompts share a stem, so requests also start from pages the prefix cache kept (of
    finished, aborted and preempted requests) while those are evicted and reused."""
    prompts = prompts_for(seed=8, lengths=(3, 12, 7, 20, 5, 16, 9, 2, 14, 6))
    stem = prompts_for(seed=9, lengths=(9, 1))[0]
    prompts = [stem + p if i % 3 else p for i, p in enumerate(prompts)]
    params = stop_params(reference(GREEDY))
    params = [params[i % len(params)] for i in range(len(prompts))]
    expected = reference(params, prompts)
    llm = LLM(
        models["target"],
        overlap_schedule="on",
        page_size=4,
        num_kv_pages=20,
        speculative_num_steps=3,
        **spec_kwargs(models, drafter),
    )
    if drafter:
        random_draft_lens(llm, seed=22)
    engine = llm.engine
    ids, finished, aborted, in_flight_aborts = churn(engine, prompts, params, arrive_p=0.6)
    assert engine.kv.allocator.num_used == 0 and not engine.requests
    assert in_flight_aborts and engine.scheduler.num_preemptions > 0
    assert engine.stats()["prefix_cache_hit_tokens"] > 0
    assert len(finished) + len(aborted) == len(prompts)
    for rid, i in ids.items():
        if rid not in aborted:
            assert finished[rid] == expected[i]


def test_drain_processes_the_step_in_flight(models, reference):
    """`loop.drain()` (benchmarks time decoding from a settled state) processes the step in
    flight without launching one, after prefill and mid-decode; outputs stay identical."""
    for drafter in (None, "eagle3"):
        llm = LLM(models["target"], overlap_schedule="on", **spec_kwargs(models, drafter))
        engine = llm.engine
        ids = [engine.add_request(p, GREEDY) for p in prompts_for()]
        finished, launched = {}, []
        for turn in range(80):
            outputs = engine.step()
            if turn in (0, 5) and engine.loop.inflight is not None:
                launched.append(engine.num_steps)
                outputs += engine.loop.drain()
                assert engine.loop.inflight is None and engine.num_steps == launched[-1]
                assert engine.loop.drain() == []  # nothing left in flight
            finished.update((o.request_id, o.token_ids) for o in outputs if o.finished)
            if not engine.has_unfinished():
                break
        assert len(launched) == 2 and not engine.has_unfinished()
        assert engine.kv.allocator.num_used == 0
        assert [finished[rid] for rid in ids] == [t for t, _, _ in reference(GREEDY)]
