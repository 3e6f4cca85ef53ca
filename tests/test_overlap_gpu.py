"""Overlap scheduling on CUDA, with CUDA graphs and the Triton backend: token-identical to
the synchronous loop, plain and speculative, with stops found one step late; device step
timing recorded. Skipped without a GPU."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from tests.overlap_cases import prompts_for, stop_params
from tests.tiny_models import make_random_eagle3_head, make_tiny_model

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


@pytest.mark.parametrize("spec", [False, True])
def test_cuda_overlap_stops_identical(gpu_models, spec):
    """fp32, so that batches of different composition (requests finishing one step late
    under overlap) cannot flip a near-tie between the two loops."""
    target, _ = gpu_models
    kw = dict(dtype="float32", max_model_len=40)
    kw.update(dict(speculative_algorithm="draft", speculative_draft_model_path=target, **SPEC)
              if spec else dict(speculative_algorithm="none"))
    prompts = prompts_for()
    _, ref = _run(target, prompts, SamplingParams(max_tokens=14, temperature=0.0,
                                                  ignore_eos=True), "off", **kw)
    params = stop_params(ref)
    _, sync = _run(target, prompts, params, "off", **kw)
    _, overlap = _run(target, prompts, params, "on", **kw)
    assert overlap == sync
    assert any(reason == "stop" for _, _, reason in sync)


def test_cuda_overlap_preemption_and_seeded(gpu_models):
    target, _ = gpu_models
    kw = dict(dtype="float32", page_size=4, num_kv_pages=40, speculative_algorithm="none")
    prompts = prompts_for()
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    _, sync = _run(target, prompts, params, "off", **kw)
    engine, overlap = _run(target, prompts, params, "on", **kw)
    assert overlap == sync
    assert engine.scheduler.num_preemptions > 0
