"""EAGLE-3 drafter graphs: head passes padded to a batch bucket and a uniform length, and
catch-up passes of any lengths padded to request and token buckets, equal the eager passes
and write only scratch page 0 beyond the real KV (eagerly on the CPU, replayed on a GPU);
greedy speculation through the padded path equals plain decoding."""

from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.layers.attention import TorchAttentionBackend
from specserve.speculative.eagle3 import capture_drafter_graphs
from specserve.speculative.policy import PerRequestPolicy, SpeculationPolicy
from tests.support.drafter_cases import drafter_catch_up_error, drafter_graph_error
from tests.support.tiny_models import VOCAB, make_random_eagle3_head, make_tiny_model


def test_graph_keys_and_which_passes_have_one():
    from specserve.core.kv_cache import KVCache
    from specserve.runtime.packing import Segment
    from specserve.speculative.eagle3 import catch_up_lengths
    from specserve.speculative.eagle3_graphs import DrafterGraphs
    from tests.support.drafter_cases import _head

    head, embed = _head(torch.float32, "cpu")
    kv = KVCache(head.config.layer, 8, 4, torch.float32, torch.device("cpu"))
    graphs = DrafterGraphs(
        head,
        embed,
        kv.layers[0],
        TorchAttentionBackend(),
        (1, 2, 4, 8, 16, 32, 48, 64, 80),
        catch_up_lengths(3),
        64,
        use_graphs=False,
        chain_lengths=(3,),
    )
    assert catch_up_lengths(3) == (1, 2, 3, 4, 8)
    assert len(graphs.keys()) == 9 * 5 + 8 * 4  # chains: buckets <= 64, catch-ups <= 4
    assert graphs.keys()[0] == (80, 8, 0)
    segs = [Segment([1, 2], 3, [7] * 3)] * 3
    assert graphs.can_run(segs) and graphs.can_run_chain(segs, 3)
    assert not graphs.can_run_chain(segs, 2)  # no chain of 2 captured
    assert not graphs.can_run_chain([Segment([1, 2], 3, [7] * 5)], 3)  # catch-up pads to 8
    assert not graphs.can_run_chain([Segment([1, 2], 6, [7])], 3)  # drafts past its pages
    assert not graphs.can_run_chain(segs * 22, 3) and graphs.can_run(segs * 22)  # 66 requests
    assert not graphs.can_run([Segment([1, 2], 3, [7] * 9)])  # a catch-up longer than 8


def test_padded_head_passes_match_eager_and_write_only_page_zero():
    assert drafter_graph_error(TorchAttentionBackend(), torch.float32, "cpu") < 1e-5


@pytest.mark.parametrize("merged", [True, False])
def test_catch_up_passes_write_the_layers_kv_and_only_page_zero_beyond(merged):
    err = drafter_catch_up_error(TorchAttentionBackend(), torch.float32, "cpu", merged=merged)
    assert err < 1e-5


def test_catch_up_graph_keys_and_which_passes_fit():
    from specserve.core.kv_cache import KVCache
    from specserve.speculative.eagle3_graphs import DrafterGraphs
    from tests.support.drafter_cases import _head

    head, embed = _head(torch.float32, "cpu")
    kv = KVCache(head.config.layer, 40, 4, torch.float32, torch.device("cpu"))
    store = torch.zeros(40 * 4, head.config.layer.hidden_size)
    args = (head, embed, kv.layers[0], TorchAttentionBackend(), (1, 4), (1, 2), 64)
    graphs = DrafterGraphs(*args, use_graphs=False, feature_store=store, catch_up_tokens=(64, 32))
    assert [key for key in graphs.keys() if key[1] == 0] == [(0, 0, 64), (0, 0, 32)]
    assert graphs.max_catch_up_tokens == 64
    assert [graphs.catch_up_bucket(n) for n in (1, 32, 33, 64, 65)] == [32, 32, 64, 64, None]
    # without a feature store to read its inputs from, a drafter captures none
    bare = DrafterGraphs(*args, use_graphs=False, catch_up_tokens=(64, 32))
    assert all(key[1] for key in bare.keys()) and bare.max_catch_up_tokens == 0
    assert bare.catch_up_bucket(1) is None


class _UniformRandomK(SpeculationPolicy):
    """One random draft length >= 2 per step for every request (the goodput policy chooses one
    K per step)."""

    def __init__(self, k_max: int, seed: int):
        super().__init__(k_max)
        self.rng = random.Random(seed)

    def choose(self, reqs, load=None):
        k = self.rng.choice(range(2, self.k_max + 1))
        return [k] * len(reqs)


@pytest.mark.parametrize(
    "policy, overlap",
    [("mixed", "off"), ("fixed", "off"), ("mixed", "on"), ("uniform", "on"), ("pause", "on")],
)
def test_padded_drafter_keeps_greedy_output(tmp_path_factory, policy, overlap):
    """mixed: random draft lengths per request (one padded pass per draft step); fixed: every
    request drafts K (whole proposing steps as chains); uniform: a random K per step for all
    (chains of every captured K); pause: plain decoding for 9 tokens, then K (the first
    drafting step's catch-up is longer than any uniform graph's: its pairs go through a
    catch-up graph first); with the overlapped loop too."""
    target = make_tiny_model(tmp_path_factory.mktemp("t"), "llama", num_layers=4)
    head = make_random_eagle3_head(tmp_path_factory.mktemp("h"), target, 200)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 9, 14, 30, 5)]
    max_tokens = 20 if policy == "pause" else 14
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(target)).generate(prompts, params)]

    def drafts_of(padded: bool):
        llm = LLM(
            str(target),
            speculative_algorithm="eagle3",
            speculative_num_steps=3,
            speculative_draft_model_path=str(head),
            speculative_policy="fixed",
            overlap_schedule=overlap,
        )
        proposer = llm.engine.spec.proposer
        seen = {"run": [], "run_chain": [], "run_catch_up": []}
        if padded:
            proposer.graphs = capture_drafter_graphs(proposer, llm.engine.target, use_graphs=False)
            for name in ("run", "run_chain"):
                fn = getattr(proposer.graphs, name)

                def spy(segments, hidden, *rest, fn=fn, name=name):
                    k = rest[0] if name == "run_chain" else None  # run_chain(.., k, tail)
                    seen[name].append((len(segments), k))
                    return fn(segments, hidden, *rest)

                setattr(proposer.graphs, name, spy)
            fn = proposer.graphs.run_catch_up
            proposer.graphs.run_catch_up = lambda segs, tail=None: (
                seen["run_catch_up"].append((len(segs), sum(len(s.token_ids) for s in segs))),
                fn(segs, tail),
            )[1]
        if policy == "mixed":
            pick = random.Random(9)
            llm.engine.spec.policy = PerRequestPolicy(3, lambda req: pick.choice([0, 1, 2, 3]))
        if policy == "uniform":
            llm.engine.spec.policy = _UniformRandomK(3, seed=5)
        if policy == "pause":
            llm.engine.spec.policy = PerRequestPolicy(
                3, lambda req: 3 if len(req.output_token_ids) >= 9 else 0
            )
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == plain
        stats = [(o.spec_stats.drafted, o.spec_stats.accepted) for o in outs]
        return stats, seen, proposer.eager_tokens

    eager_stats, _, eager_tokens = drafts_of(False)
    padded_stats, seen, padded_tokens = drafts_of(True)
    passes = [n for n, _ in (seen["run"] if policy == "mixed" else seen["run_chain"])]
    assert len(passes) > 5 and max(passes) > 1  # padded passes ran, some with 2+ requests
    # the prompts' pairs (13 and 29 of them: longer than any uniform catch-up) went through
    # catch-up graphs, and the padded drafter ran no pass eagerly
    assert max(tokens for _, tokens in seen["run_catch_up"]) >= 29
    assert eager_tokens > 0 and padded_tokens == 0
    if policy == "uniform":  # chains of every K >= 2 were captured and used
        assert {k for _, k in seen["run_chain"]} == {2, 3}
    assert padded_stats == eager_stats  # same drafts, so the same acceptance


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [drafter_graph_error, drafter_catch_up_error])
def test_gpu_drafter_graphs_match_eager(dtype, case):
    """Uniform passes and chains; catch-ups that only write the head's KV."""
    from specserve.layers import triton_ops
    from specserve.layers.attention.triton_attn import TritonAttentionBackend

    err = case(
        TritonAttentionBackend(), dtype, "cuda", use_graphs=True, page_size=16, fused_ops=triton_ops
    )
    assert err < 2e-2, err


@pytest.mark.gpu
def test_gpu_engine_captures_and_drafts_through_graphs(tmp_path_factory):
    target = make_tiny_model(tmp_path_factory.mktemp("t"), "llama", num_layers=4)
    head = make_random_eagle3_head(tmp_path_factory.mktemp("h"), target, 200)
    llm = LLM(
        str(target),
        device="cuda",
        speculative_algorithm="eagle3",
        max_num_seqs=8,
        speculative_num_steps=3,
        speculative_draft_model_path=str(head),
        speculative_policy="fixed",
    )
    graphs = llm.engine.spec.proposer.graphs
    assert graphs is not None and graphs.report.num_graphs == len(graphs.keys()) > 0
    assert any(key[1] == 0 for key in graphs.keys())  # catch-ups of any lengths
    passes, catch_ups = [], []
    for name in ("run", "run_chain"):
        fn = getattr(graphs, name)
        setattr(graphs, name, lambda *a, fn=fn: (passes.append(len(a[0])), fn(*a))[1])
    fn = graphs.run_catch_up
    graphs.run_catch_up = lambda segs, tail=None: (
        catch_ups.append(sum(len(s.token_ids) for s in segs)),
        fn(segs, tail),
    )[1]
    # the 40-token prompt's pairs are longer than any uniform catch-up graph's
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12] * 9, [13] * 40]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 12 for o in outs)
    assert len(passes) >= 3 and sum(o.spec_stats.drafted for o in outs) > 0
    assert catch_ups and max(catch_ups) >= 39
    off = LLM(
        str(target),
        device="cuda",
        speculative_algorithm="eagle3",
        disable_cuda_graph=True,
        speculative_draft_model_path=str(head),
        max_num_seqs=8,
    )
    assert off.engine.spec.proposer.graphs is None and off.engine.runner.graphs is None
