"""Overlap scheduling (engine/step_loop.py) changes no output: token-identical to the
synchronous loop for greedy and seeded sampling, with and without speculation (random
per-step draft lengths), stops landing mid-draft and mid-batch, max_tokens and the context
limit, forced preemption, padded graph-shaped steps; same work done; and no KV page left
(aborts and arrivals mid-flight: test_overlap_lifecycle.py)."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.core.config import EngineConfig
from specserve.core.errors import ConfigError
from tests.support.overlap_cases import (
    GREEDY,
    count_gathers,
    generate,
    make_models,
    make_reference,
    prompts_for,
    random_draft_lens,
    run_engine,
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


@pytest.mark.parametrize("kw", [{}, dict(page_size=1), dict(page_size=4, max_num_batched_tokens=9)])
def test_plain_greedy_identical(models, reference, kw):
    _, outs = generate(models, prompts_for(), GREEDY, "on", **kw)
    assert outs == reference(GREEDY)


@pytest.mark.parametrize("drafter", ["copy", "random", "ngram", "eagle3"])
def test_speculative_greedy_identical_random_draft_lengths(models, reference, drafter):
    llm, outs = generate(
        models, prompts_for(), GREEDY, "on", drafter, random_k=True, speculative_num_steps=4
    )
    assert outs == reference(GREEDY)
    assert sum(k * n for k, n in enumerate(llm.engine.spec.policy.trace.steps_by_draft_len))


@pytest.mark.parametrize("drafter", ["copy", "eagle3"])
def test_goodput_policy_identical(models, reference, drafter):
    """The goodput policy decides from statistics one step old under overlap (and observes
    the step's time when it is processed): outputs stay identical."""
    kw = dict(spec_kwargs(models, drafter), speculative_policy="goodput")
    llm = LLM(models["target"], overlap_schedule="on", **kw)
    outs = llm.generate(prompts_for(), GREEDY)
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == reference(GREEDY)
    assert llm.engine.kv.allocator.num_used == 0
    # every step's period observed when processed (the last observed goodput alone could
    # be 0: a step run ahead after every request finished commits nothing)
    stats = llm.engine.spec.stats()
    assert sum(stats["spec_timed_steps_by_step_k"]) > 0
    assert all(
        ms > 0
        for ms, n in zip(stats["spec_period_ms_by_step_k"], stats["spec_timed_steps_by_step_k"])
        if n
    )


@pytest.mark.parametrize("drafter", [None, "copy", "eagle3"])
def test_stops_and_max_tokens_identical(models, reference, drafter):
    params = stop_params(reference(GREEDY))
    expected = reference(params, max_model_len=40)
    assert [len(t) for t, _, _ in expected][3:5] == [1, 2]
    assert any(r == "stop" for _, _, r in expected)
    assert len(expected[7][0]) == 40 - len(prompts_for()[7])  # stopped by the context limit
    _, outs = generate(
        models, prompts_for(), params, "on", drafter, speculative_num_steps=7, max_model_len=40
    )
    assert outs == expected


@pytest.mark.parametrize("drafter", [None, "random", "eagle3"])
def test_preemption_identical(models, reference, drafter):
    kw = dict(page_size=4, num_kv_pages=24)
    llm, outs = generate(
        models,
        prompts_for(),
        GREEDY,
        "on",
        drafter,
        random_k=bool(drafter),
        speculative_num_steps=3,
        **kw,
    )
    assert outs == reference(GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("drafter", ["eagle3", "ngram"])
def test_a_lone_request_that_fits_is_never_preempted(models, drafter):
    """A request whose tokens fit the cache, drafting K=4 past max_tokens under overlap: the
    next step (scheduled before this one's drafts resolve) finds its slot in the lookahead
    instead of preempting the request itself for it (every prompt length and max_tokens
    that fit a 16-token cache, page size 1)."""
    llm = LLM(
        models["target"],
        page_size=1,
        num_kv_pages=17,
        overlap_schedule="on",
        speculative_num_steps=4,
        **spec_kwargs(models, drafter),
    )
    for prompt_len in range(2, 16, 3):
        for max_tokens in range(1, 17 - prompt_len, 2):
            prompt = list(range(5, 5 + prompt_len))
            out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            assert len(out[0].token_ids) == max_tokens
    assert llm.engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("drafter", [None, "random"])
def test_seeded_sampling_and_logprobs_identical(models, drafter):
    prompts = prompts_for()
    params = [
        SamplingParams(
            max_tokens=12, temperature=0.9, top_p=0.95, seed=100 + i, logprobs=2, ignore_eos=True
        )
        for i in range(len(prompts))
    ]
    params[3] = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
    params[4] = SamplingParams(max_tokens=12, temperature=0.7, seed=5, ignore_eos=True)
    results = {}
    for overlap in ("off", "on"):
        llm = LLM(models["target"], overlap_schedule=overlap, **spec_kwargs(models, drafter))
        results[overlap] = run_engine(llm.engine, prompts, params)
    assert results["on"] == results["off"]
    assert all(len(lps) == 12 for i, (_, lps) in enumerate(results["on"]) if i != 4)


def test_config_flags():
    assert EngineConfig.from_flags(model="x", device="cpu").overlap_enabled() is False
    assert EngineConfig.from_flags(model="x", device="cpu", overlap_schedule="on").overlap_enabled()
    assert not EngineConfig.from_flags(
        model="x", device="cuda", disable_overlap_schedule=True, speculative_algorithm="none"
    ).overlap_enabled()
    assert EngineConfig.from_flags(
        model="x", device="cuda", speculative_algorithm="none"
    ).overlap_enabled()
    with pytest.raises(ConfigError, match="overlap_schedule"):
        EngineConfig.from_flags(model="x", overlap_schedule="sometimes")
    with pytest.raises(ConfigError, match="contradicts"):
        EngineConfig.from_flags(model="x", overlap_schedule="on", disable_overlap_schedule=True)
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
        llm = LLM(
            models["target"],
            overlap_schedule=overlap,
            **spec_kwargs(models, "copy"),
            speculative_num_steps=3,
        )
        fed = []
        schedule = llm.engine.scheduler.schedule

        def spy(policy=None, schedule=schedule, fed=fed):
            batch = schedule(policy)
            fed.append(sum(s.num_tokens for s in batch))
            # Once generating, a request feeds only its newest token (its accepted drafts
            # are cached already): nothing is recomputed.
            assert all(s.num_tokens == 1 for s in batch if s.request.num_generated > 0)
            return batch

        spy_on(llm.engine.scheduler, "schedule", spy)
        outs = llm.generate(prompts_for(), GREEDY)
        stats = [(o.spec_stats.drafted, o.spec_stats.accepted) for o in outs]
        results[overlap] = (llm.engine.num_steps, sum(fed), stats)
        assert all(d == a > 0 for d, a in stats)
    assert results["on"] == results["off"]


@pytest.mark.parametrize("drafter", [None, "eagle3"])
def test_graph_padded_steps_identical(models, reference, drafter):
    """Through the CUDA graph runner's padded static buffers (eagerly, on the CPU): padded
    decode steps whose input ids are gathered from the step in flight."""
    from tests.support.model_cases import install_padded_runner

    llm = LLM(models["target"], overlap_schedule="on", page_size=4, **spec_kwargs(models, drafter))
    spec = llm.engine.spec
    calls = install_padded_runner(
        llm, q_lens=(1, 2, 3, 4), aux_layer_ids=spec.aux_layer_ids if spec else ()
    )
    if drafter:
        random_draft_lens(llm, seed=4)
    seen = count_gathers(llm)
    outs = llm.generate(prompts_for(), GREEDY)
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == reference(GREEDY)
    assert calls["graph"] > 5 and (drafter or seen["gathered"] > 0)
    assert llm.engine.kv.allocator.num_used == 0


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_host_time_by_part(models, overlap):
    """The loop accounts its host time by part (metrics: specserve_engine_host_ms{part}):
    every part of a speculative step is there, none negative, and together with the waits
    for drawn tokens they fit in the time the steps took."""
    import time

    llm = LLM(models["target"], overlap_schedule=overlap, **spec_kwargs(models, "eagle3"))
    start = time.perf_counter()
    llm.generate(prompts_for(), GREEDY)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    stats = llm.engine.stats()
    host = stats["host_ms_by_part"]
    assert set(host) == {"schedule", "draft", "prepare", "forward", "sample", "process"}
    assert min(host.values()) >= 0 and host["draft"] > 0
    assert sum(host.values()) + stats["host_wait_ms"] <= elapsed_ms


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_steps_by_kind(models, overlap):
    """The loop counts its steps by kind (metrics: specserve_engine_step_kind_*): every
    processed step once, as "prefill" while a prompt chunk rides along and "decode" when
    every row decodes, with the K it verified; a prompt arriving while others decode makes
    a prefill step at K > 0 (the decode rows draft beside the chunk), and each kind's time
    is accounted (host time on the CPU) within the run's."""
    import time

    llm = LLM(
        models["target"],
        overlap_schedule=overlap,
        speculative_num_steps=2,
        **spec_kwargs(models, "eagle3"),
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(prompts_for()[6], params)  # 31 tokens: one chunk
    for _ in range(4):  # it decodes (K=2 from its first decode step)
        engine.step()
    engine.add_request(prompts_for()[4], params)  # arrives mid-decode
    while engine.has_unfinished():
        engine.step()
    elapsed_ms = (time.perf_counter() - start) * 1e3
    stats = engine.stats()
    kinds, ms = stats["steps_by_kind"], stats["step_ms_by_kind"]
    assert sum(kinds.values()) == engine.num_steps
    assert set(kinds) == set(ms) <= {"decode K=0", "decode K=2", "prefill K=0", "prefill K=2"}
    assert kinds["prefill K=0"] == 1  # the first prompt alone
    assert kinds["prefill K=2"] == 1  # the second beside the first's verify row
    assert kinds["decode K=2"] >= 4
    assert 0 < sum(ms.values()) <= elapsed_ms and min(ms.values()) > 0

    plain = LLM(models["target"], overlap_schedule=overlap)
    plain.generate(prompts_for()[:3], GREEDY)
    kinds = plain.engine.stats()["steps_by_kind"]
    assert set(kinds) == {"prefill K=0", "decode K=0"}
    assert sum(kinds.values()) == plain.engine.num_steps


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_waits_while_sampling_count_as_waits(models, overlap):
    """Time the host waits for the device while sampling (StepInput.sample_wait_ms: a
    grammar's drafts, a mask buffer still being copied) is counted with the waits, not in
    the sample part, where it would pass for host work."""
    llm = LLM(models["target"], overlap_schedule=overlap)
    runner, steps = llm.engine.runner, []
    sample = runner.sample_async

    def waited(step, *args):
        step.sample_wait_ms += 1000.0  # as if sampling had waited a second for the device
        steps.append(step)
        return sample(step, *args)

    spy_on(runner, "sample_async", waited)
    llm.generate(prompts_for(), GREEDY)
    stats = llm.engine.stats()
    assert len(steps) > 5
    assert stats["host_wait_ms"] >= 1000.0 * len(steps)
    assert stats["host_ms_by_part"]["sample"] < 0  # the second a step came out of it
