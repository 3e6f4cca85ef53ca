"""The goodput policy under the overlap loop: its K changes between steps (probes, switches)
and drafts past max_tokens (their tokens dropped) keep outputs equal to plain decoding,
and with one draft length per step (greedy, EAGLE-3) no step waits for the previous step's
tokens; waits that do happen (the context limit) are counted by reason in engine.stats()."""

from __future__ import annotations

from unittest import mock

import pytest

from specserve import LLM, SamplingParams
from specserve.speculative.cost_model import CurveModel, StepCostModel
from specserve.speculative.speculator import Speculator
from tests.support.overlap_cases import make_models, make_reference, prompts_for
from tests.support.spies import spy_on

# The step costs the policy sees, in ms (target by tokens per step, drafter by batch): fixed,
# so that its decisions depend on the tokens alone, not on how busy the test machine is.
TARGET_MS = {1: 10.0, 2: 10.4, 4: 11.0, 8: 12.0, 16: 14.0, 32: 18.0, 64: 26.0}
DRAFTER_MS = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(models):
    return make_reference(models)


def fixed_costs(spec, engine) -> StepCostModel:
    """Speculator.measure_costs' stand-in: the tables above instead of timing the models."""
    return StepCostModel(CurveModel(TARGET_MS), CurveModel(DRAFTER_MS))


def synthetic_clock(spec) -> None:
    """Each step's period comes from the cost table (target pass plus one drafter pass per
    draft token) instead of perf_counter: the policy's trace is the same on every machine."""
    observe, clock = spec.observe_period, [0.0]

    def observe_period(batch, resolved_s, after_idle, device_ms=None, **step):
        decoding = [s for s in batch if s.decoding] or batch
        k = max((len(s.drafts) for s in decoding), default=0)
        n = len(decoding)
        ms = CurveModel(TARGET_MS)(n * (k + 1)) + k * CurveModel(DRAFTER_MS)(n)
        clock[0] += ms / 1e3
        observe(batch, clock[0], after_idle, device_ms, **step)

    spy_on(spec, "observe_period", observe_period)


def goodput(models, overlap: str, **kw) -> LLM:
    with mock.patch.object(Speculator, "measure_costs", fixed_costs):
        llm = LLM(
            models["target"],
            overlap_schedule=overlap,
            speculative_algorithm="eagle3",
            speculative_draft_model_path=models["eagle3"],
            speculative_num_steps=3,
            speculative_policy="goodput",
            **kw,
        )
    synthetic_clock(llm.engine.spec)
    policy = llm.engine.spec.policy
    # Probe every K often (each probe is a switch there and back): K changes every few steps.
    policy.PROBE_EVERY, policy.PROBE_MIN_GAIN, policy.PROBE_MAX_INTERVAL = 1, 0.0, 4
    policy.PROBE_BUDGET = policy.PROBE_MAX_BUDGET = 1.0
    return llm


def k_changes(llm) -> int:
    max_draft_lens = [d["k"] for d in llm.engine.spec.policy.trace.dump()]
    return sum(a != b for a, b in zip(max_draft_lens, max_draft_lens[1:]))


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_batch1_k_changes_and_caps_run_ahead(models, reference, overlap):
    """Requests one after another, K changing between steps and capped near each request's
    end (max_tokens 5..40): outputs equal plain decoding; the overlap loop never waits."""
    prompts = prompts_for()[:4]
    limits = [40, 5, 23, 9]
    outs = []
    llm = goodput(models, overlap)
    for prompt, n in zip(prompts, limits):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        out = llm.generate([prompt], params)[0]
        outs.append((out.token_ids, out.text, out.finish_reason))
        want = reference(params, [prompt])[0]
        assert outs[-1] == want
    stats = llm.engine.stats()
    assert k_changes(llm) >= 10
    assert stats["loop_waits"] == 0 and stats["loop_wait_reasons"] == {}
    assert llm.engine.kv.allocator.num_used == 0


def _batch_generate(llm, prompts, params):
    return [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("policy", ["k3", "goodput_padded"])
def test_max_tokens_batch_drafts_past_the_end_without_waits(models, reference, policy):
    """Requests of one batch reaching their max_tokens at different steps: with K=3 for
    every request (a fixed K, or goodput with verify steps padded as under CUDA graphs)
    each draws full drafts up to its end, past max_tokens, so draft lengths stay uniform
    and the overlap loop never waits; the tokens past max_tokens never reach the client:
    outputs equal plain decoding."""
    prompts = prompts_for()[:4]
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (30, 6, 17, 11)
    ]
    want = [reference(p, [q])[0] for p, q in zip(params, prompts)]
    llm = goodput(models, "on")
    spec = llm.engine.spec
    if policy == "k3":
        spec.policy.choose = lambda reqs, extra=0: [3] * len(reqs)
    else:  # the goodput policy as under CUDA graphs: K probed and switched, caps padded
        spec.cost.padded = True
    draft_lens_by_step = []
    schedule = llm.engine.scheduler.schedule

    def spy(p=None):
        batch = schedule(p)
        draft_lens_by_step.append([s.draft_len for s in batch if s.decoding])
        return batch

    spy_on(llm.engine.scheduler, "schedule", spy)
    assert _batch_generate(llm, prompts, params) == want
    stats = llm.engine.stats()
    assert stats["loop_waits"] == 0 and stats["loop_wait_reasons"] == {}
    assert all(len(set(draft_lens)) <= 1 for draft_lens in draft_lens_by_step)
    if policy == "k3":  # the last steps of short requests drafted past their end
        assert sum(1 for draft_lens in draft_lens_by_step if draft_lens and draft_lens[0] == 3) >= 9
    assert llm.engine.kv.allocator.num_used == 0


def test_context_limit_keeps_the_cap(models, reference):
    """Requests limited by the context (not max_tokens) never draft past it: their draft
    length is capped near the end (such steps may wait); outputs equal plain decoding."""
    prompts = prompts_for()[:4]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    want = reference(params, prompts, max_model_len=48)
    llm = goodput(models, "on", max_model_len=48)
    llm.engine.spec.policy.choose = lambda reqs, extra=0: [3] * len(reqs)
    schedule = llm.engine.scheduler.schedule

    def spy(p=None):
        batch = schedule(p)
        for s in batch:
            assert s.request.committed_len + s.draft_len < 48
        return batch

    spy_on(llm.engine.scheduler, "schedule", spy)
    got = _batch_generate(llm, prompts, params)
    assert got == want
    assert all(reason == "length" for _, _, reason in got)
    stats = llm.engine.stats()
    assert set(stats["loop_wait_reasons"]) <= {"mixed_draft_lens", "context_limit"}


def test_the_policy_tables_reach_the_stats_and_metrics(models):
    """The goodput policy's tables, as it decides by them, in engine.stats() and on /metrics
    (labelled by batch bucket): the steady periods it learned under the synthetic clock
    (a step of one request at K: the target over K + 1 tokens and K drafter passes), the
    switch costs and the modes' factors it measured, and what its last decode-only decision
    at a bucket expected of each K."""
    from specserve.bench.metrics_client import parse_metrics, speculation_figures
    from specserve.server.metrics import ServerMetrics

    llm = goodput(models, "off")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for prompt in prompts_for()[:3]:
        llm.generate([prompt], params)
    stats = llm.engine.stats()
    periods, seen = stats["spec_policy_period_ms"], stats["spec_policy_period_observations"]
    assert set(periods) == set(seen) and {"1:0", "1:3"} <= set(periods)
    for k in (0, 3):
        want = CurveModel(TARGET_MS)(k + 1) + k * CurveModel(DRAFTER_MS)(1)
        assert periods[f"1:{k}"] == pytest.approx(want, rel=1e-3) and seen[f"1:{k}"] > 0
    assert stats["spec_policy_switch_observations"]  # (K changes every few steps here)
    assert set(stats["spec_policy_mode_factor"]) == set(stats["spec_policy_mode_steps"])
    metrics = ServerMetrics()
    metrics.engine_stats = lambda: stats
    text = metrics.render().decode()
    exported = parse_metrics(text)  # (in seconds, Prometheus' base unit)
    cell = ("specserve_spec_policy_period_seconds", (("bucket", "1"), ("k", "3")))
    assert exported[cell] == pytest.approx(periods["1:3"] / 1000)
    price = stats["spec_policy_prefill_price_tokens_per_s"]  # (the marginal ranking's price)
    assert price == pytest.approx(llm.engine.spec.policy.rate.price * 1e3) and price > 0
    name = "specserve_spec_policy_prefill_price_tokens_per_second"
    assert exported[(name, ())] == pytest.approx(price)
    tables = speculation_figures({}, exported)["policy_tables"]  # (back in ms)
    assert tables["period_ms"]["1"]["3"] == pytest.approx(periods["1:3"])
    assert tables["switch_observations"]["1"] == {
        cell.split(":")[1]: n
        for cell, n in stats["spec_policy_switch_observations"].items()
        if cell.startswith("1:")
    }
    # what the last decode-only deliberation at one request expected of each K: a request
    # commits 1 token at K = 0 and more at K > 0, in the period it ranked K by (the cost
    # model's at one request: no context term in this engine's cost model, no surcharge)
    # (a request's last steps may draft fewer: the decision ranked K = 0 .. its cap)
    num_reqs, tokens, periods = llm.engine.spec.policy.trace.last_expected[1]
    top = len(tokens) - 1
    expected, ranked = stats["spec_policy_expected_tokens"], stats["spec_policy_expected_period_ms"]
    assert num_reqs == 1 and top >= 1
    assert set(expected) == set(ranked) == {f"1:{k}" for k in range(top + 1)}
    assert [expected[f"1:{k}"] for k in range(top + 1)] == pytest.approx(tokens)
    assert [ranked[f"1:{k}"] for k in range(top + 1)] == pytest.approx(periods)
    # (a random head: drafts rarely accepted, so K > 0 expects little more than K = 0)
    assert expected["1:0"] == pytest.approx(1.0) and expected[f"1:{top}"] >= 1.0
    assert min(ranked.values()) > 0
    cell = ("specserve_spec_policy_expected_period_seconds", (("bucket", "1"), ("k", str(top))))
    assert exported[cell] == pytest.approx(ranked[f"1:{top}"] / 1000)
    assert tables["expected_period_ms"]["1"][str(top)] == pytest.approx(ranked[f"1:{top}"])
    assert tables["expected_tokens"]["1"][str(top)] == pytest.approx(expected[f"1:{top}"])


def test_a_step_is_observed_with_the_drafter_state_it_ran_with(models):
    """Under overlap a step is processed after the next one was scheduled, so the policy may
    have gone dormant or woken since: the speculator gets each step's own state from its
    launch (a wake's step ran without the drafter's upkeep, and its span shows it)."""
    from specserve.engine.step_loop import StepLoop

    llm = goodput(models, "on")
    spec, loop = llm.engine.spec, llm.engine.loop
    launched, observed, current = [], [], []
    launch = loop._launch

    def spy_launch(prev, batch, drafting, keeps_drafter, late, waited=False):
        step = launch(prev, batch, drafting, keeps_drafter, late, waited)
        if step is not None:
            launched.append(keeps_drafter)
            spec.policy.dormant = len(launched) % 3 == 0  # (the next step's state flips)
        return step

    observe = spec.observe_period

    def spy_observe(batch, resolved_s, after_idle, device_ms=None, **step):
        observed.append(step["kept_drafter"])
        current.append(spec.keeps_drafter)
        observe(batch, resolved_s, after_idle, device_ms, **step)

    spy_on(loop, "_launch", spy_launch)
    spy_on(spec, "observe_period", spy_observe)
    assert isinstance(loop, StepLoop)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm.generate(prompts_for()[:2], params)
    assert len(observed) == len(launched) >= 12
    assert observed == launched  # in launch order, as each was launched
    assert observed != current  # (the policy's state at processing time differs)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_the_drafters_upkeep_beside_prefill_is_measured(models, overlap):
    """A prompt arriving while another request decodes, the drafter kept up: the step loop
    times the drafter's passes over the new prompt, hands them to the speculator with the
    host's wait for the step's tokens, and the policy's `upkeep` learns what the host had
    no time to spare for (the decision records both); with the drafter dormant there is
    no upkeep to measure."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(dormant: bool):
        llm = goodput(models, overlap)
        engine, spec = llm.engine, llm.engine.spec
        if dormant:  # (every decision leaves it dormant)
            choose = spec.policy.choose

            def dormant_choice(*args, **kw):
                draft_lens = choose(*args, **kw)
                spec.policy.dormant = True
                return draft_lens

            spy_on(spec.policy, "choose", dormant_choice)
        seen = []
        observe = spec.observe_period

        def spy(batch, resolved_s, after_idle, device_ms=None, **step):
            if any(s.decoding for s in batch) and not all(s.decoding for s in batch):
                seen.append((step["kept_drafter"], step["upkeep"]))
            observe(batch, resolved_s, after_idle, device_ms, **step)

        spy_on(spec, "observe_period", spy)
        engine.add_request(prompts_for()[6], params)
        for _ in range(4):
            engine.step()
        engine.add_request(prompts_for()[4], params)  # arrives mid-decode
        while engine.has_unfinished():
            engine.step()
        return spec, seen

    spec, seen = run(dormant=False)
    [(kept, (host_ms, wait_ms))] = seen
    assert kept and host_ms > 0 and wait_ms >= 0
    assert spec.policy.upkeep.steps == 1
    assert spec.policy.upkeep._ms == pytest.approx(max(0.0, host_ms - wait_ms))
    [decision] = [d for d in spec.policy.trace.recent if d.upkeep_ms is not None]
    assert (decision.upkeep_ms, decision.wait_ms) == (host_ms, wait_ms)
    assert "spec_policy_prefill_upkeep_ms" in spec.stats()
    spec, seen = run(dormant=True)
    assert seen == [(False, None)] and spec.policy.upkeep.steps == 0
