"""EAGLE-3 features taken inside the target's CUDA graphs: the fc projection and the feature
store write run in the graph (on its static slot mapping), so a step that does not draft
costs the host what a plain step costs, and the store holds the same bits as when the
features were taken eagerly after the replay. On the CPU through the graph runner's padded
path run eagerly; on a GPU (marked) through captured graphs. ("plain": a speculating engine
whose every step has K=0; under the off policy the target keeps no features at all.)"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specserve import LLM, SamplingParams
from specserve.runtime.cuda_graphs import CudaGraphRunner
from specserve.speculative.eagle3 import capture_drafter_graphs
from tests.support.model_cases import install_padded_runner
from tests.support.overlap_cases import StepDraftLens, make_models, prompts_for, spec_kwargs
from tests.support.spies import spy_on

PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


def _policy(name: str) -> StepDraftLens:
    return StepDraftLens(3, seed=7, choices=(0,) if name == "plain" else (0, 0, 1, 3))


def _eagle3(models, policy: str, in_graph: bool, **kw) -> LLM:
    kw = {
        "speculative_num_steps": 3,
        **spec_kwargs(models, "eagle3"),
        "page_size": 4,
        "overlap_schedule": "on",
        **kw,
    }
    if policy != "plain":
        kw["speculative_simulate_acceptance"] = 0.6  # accept lengths move the slots
    llm = LLM(models["target"], **kw)
    llm.engine.spec.policy = _policy(policy)
    install_padded_runner(
        llm,
        q_lens=(1, 2, 3, 4),
        aux_layer_ids=llm.engine.spec.aux_layer_ids,
        in_graph=in_graph,
    )
    proposer = llm.engine.spec.proposer
    proposer.graphs = capture_drafter_graphs(proposer, llm.engine.target, use_graphs=False)
    return llm


def _watch_aux(llm) -> dict:
    """Counts graph steps and those that handed aux back to the loop."""
    graphs, seen = llm.engine.runner.graphs, {"graph": 0, "aux": 0}
    run = graphs.run

    def watched(*args):
        hidden, aux = run(*args)
        seen["graph"] += 1
        seen["aux"] += bool(aux)
        return hidden, aux

    spy_on(graphs, "run", watched)
    return seen


@pytest.mark.parametrize("policy", ["plain", "mixed"])
@pytest.mark.parametrize("num_prompts", [3, 4])  # padded to bucket 4, and not
def test_store_after_graph_path_steps_equals_eager_features(models, policy, num_prompts):
    prompts = prompts_for()[:num_prompts]
    outs, stores = {}, {}
    for in_graph in (False, True):
        llm = _eagle3(models, policy, in_graph)
        seen = _watch_aux(llm)
        outs[in_graph] = [o.token_ids for o in llm.generate(prompts, PARAMS)]
        page = llm.engine.kv.page_size
        stores[in_graph] = llm.engine.spec.proposer.feature_store[page:].clone()  # no scratch
        assert seen["graph"] > 10
        assert seen["aux"] == (0 if in_graph else seen["graph"])
    assert outs[True] == outs[False]
    assert stores[True].abs().sum() > 0
    if num_prompts == 4:  # the same shapes: the same bits
        assert torch.equal(stores[True], stores[False])
    else:  # the graph projects its padded rows (4 per step), the old path only the real 3:
        # the CPU's GEMM rounds by row count (a GPU's too, unless its kernel is row-invariant)
        torch.testing.assert_close(stores[True], stores[False], rtol=1e-5, atol=1e-5)


class _FreeReplay:
    """A captured graph whose replay costs nothing: its outputs were computed once."""

    def replay(self) -> None:
        pass


class _CountCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _ops_per_step(llm, aux_layer_ids, steps: int = 8) -> list[list[str]]:
    """Torch calls of each steady decode step of 3 requests, graph replays free."""
    install_padded_runner(llm, q_lens=(1,), aux_layer_ids=aux_layer_ids, mixed=False)
    graphs = llm.engine.runner.graphs
    with torch.inference_mode():
        graphs._graphs = {key: (_FreeReplay(), *graphs._forward(*key)) for key in graphs.keys()}
    graphs.use_graphs = True
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 20, temperature=0.0, ignore_eos=True)
    for prompt in prompts_for()[:3]:
        engine.add_request(prompt, params)
    for _ in range(6):  # prefill, then decoding in the overlap loop's steady state
        engine.step()
    calls = []
    for _ in range(steps):
        mode = _CountCalls()
        with mode:
            engine.step()
        calls.append(mode.names)
    return calls


def test_a_step_that_does_not_draft_makes_the_torch_calls_of_a_plain_step(models):
    plain = LLM(models["target"], page_size=4, overlap_schedule="on")
    k0 = _eagle3(models, "plain", in_graph=True)
    assert k0.engine.spec.aux_layer_ids  # (features taken, inside the graphs)
    plain_calls = _ops_per_step(plain, ())
    k0_calls = _ops_per_step(k0, k0.engine.spec.aux_layer_ids)
    assert k0_calls == plain_calls
    assert "index_copy_" not in sum(k0_calls, [])


# ---- GPU: captured graphs -------------------------------------------------------------


def _gpu_engine(models, policy: str, in_graph: bool) -> LLM:
    kw = {
        "speculative_num_steps": 3,
        **spec_kwargs(models, "eagle3"),
        "device": "cuda",
        "overlap_schedule": "on",
        # decode and verify graphs alone: the shadow store below mirrors their steps (a
        # mixed step's graph keeps no aux to mirror; tests/runtime/test_cuda_graphs.py
        # and the CPU cases above cover mixed steps)
        "cuda_graph_max_tokens": 0,
    }
    if policy != "plain":
        kw["speculative_simulate_acceptance"] = 0.6
    llm = LLM(models["target"], **kw)
    engine = llm.engine
    engine.spec.policy = _policy(policy)
    assert engine.runner.graphs is not None and engine.runner.graphs.feature_writer is not None
    if not in_graph:  # as before: graphs return the aux, features projected eagerly after
        old = engine.runner.graphs
        graphs = CudaGraphRunner(
            old.model,
            old.kv_layers,
            old.backend,
            old.batch_buckets,
            old.q_lens,
            old.max_seq_len,
            old.aux_layer_ids,
        )
        del old
        engine.runner.graphs = None
        graphs.capture()
        engine.runner.graphs = graphs
    return llm


def _shadow_store(llm) -> torch.Tensor:
    """A second store, written eagerly step by step by the same ops at the same shapes: on a
    graph step from the graph's own aux outputs and static slot mapping, else from the aux
    the step hands to `features`."""
    proposer, graphs = llm.engine.spec.proposer, llm.engine.runner.graphs
    shadow = proposer.feature_store.clone()

    def project(aux, slots):
        with torch.inference_mode():
            x = torch.cat(aux, dim=-1).to(proposer.head.fc.weight.dtype)
            shadow.index_copy_(0, slots, proposer.head.project(x))

    run, features = graphs.run, proposer.features

    def graph_step(input_ids, meta):
        out = run(input_ids, meta)
        batch, q_len = graphs.bucket_for(meta.num_requests), meta.max_query_len
        project(graphs._graphs[(batch, q_len)][2], graphs.slot_mapping[: batch * q_len])
        return out

    def eager_step(aux, slots=None):
        if aux:
            project(aux, slots)
        return features(aux, slots)

    graphs.run, proposer.features = graph_step, eager_step
    return shadow


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["plain", "mixed"])
@pytest.mark.parametrize("num_prompts", [3, 4, 8])  # padded to bucket 4, and not
def test_gpu_store_after_graph_steps_equals_eager_features(models, policy, num_prompts):
    """Against the graphs as before (aux out, features projected eagerly on the real rows):
    the same bits where the shapes are the same (every batch a bucket); with padding, the
    graph's projection equals the same ops run eagerly at its shapes, bit for bit."""
    prompts = prompts_for()[:num_prompts]
    outs, stores = {}, {}
    for in_graph in (False, True):
        llm = _gpu_engine(models, policy, in_graph)
        seen = _watch_aux(llm)
        shadow = _shadow_store(llm) if in_graph else None
        outs[in_graph] = [o.token_ids for o in llm.generate(prompts, PARAMS)]
        page = llm.engine.kv.page_size
        stores[in_graph] = llm.engine.spec.proposer.feature_store[page:].cpu()
        assert seen["graph"] > 10
        assert seen["aux"] == (0 if in_graph else seen["graph"])
        if shadow is not None:
            assert torch.equal(stores[True], shadow[page:].cpu())
        del llm
    assert outs[True] == outs[False]
    assert stores[True].abs().sum() > 0
    new, old = stores[True].float(), stores[False].float()
    if num_prompts != 3:
        assert torch.equal(stores[True], stores[False]), f"max diff {(new - old).abs().max()}"
    else:  # M = 4 (K+1) rows in the graph, 3 (K+1) before: bits may differ by kernel choice
        torch.testing.assert_close(new, old, rtol=2e-2, atol=2e-2)
