"""The CUDA-graph runner: bucketing, padding that touches only scratch page 0, and (on a
GPU) captured graphs that reproduce the eager forward."""

from __future__ import annotations

import pytest
import torch

from specserve.layers.attention import TorchAttentionBackend
from specserve.runtime.cuda_graphs import CudaGraphRunner
from specserve.runtime.graph_shapes import default_batch_buckets
from tests.support.model_cases import (
    build_meta,
    runner_mixed_error,
    runner_padding_error,
    tiny_config,
    tiny_model,
)


def test_default_buckets_cover_every_batch_size():
    buckets = default_batch_buckets(100)
    assert buckets[:4] == (1, 2, 4, 8) and buckets[-1] == 100
    assert default_batch_buckets(1) == (1,)


def _runner(use_graphs=False, device="cpu", backend=None):
    cfg = tiny_config()
    model = tiny_model(cfg, torch.float32, device)
    from specserve.core.kv_cache import KVCache

    kv = KVCache(cfg, 16, 4, torch.float32, device)
    backend = backend or TorchAttentionBackend()
    return CudaGraphRunner(
        model, kv.layers, backend, (1, 4, 8), (1, 4), max_seq_len=32, use_graphs=use_graphs
    )


def test_bucket_and_can_run():
    runner = _runner()
    assert [runner.bucket_for(n) for n in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]
    uniform = build_meta([[1, 2, 3], [4, 5]], [5, 2], [9, 6], 4, "cpu")  # 4 tokens each
    assert runner.can_run(uniform, 8)
    ragged = build_meta([[1, 2, 3], [4, 5]], [5, 2], [9, 5], 4, "cpu")  # 4 and 3 tokens
    assert not runner.can_run(ragged, 7)
    too_long = build_meta([list(range(1, 10))], [33], [34], 4, "cpu")
    assert not runner.can_run(too_long, 1)
    assert runner.keys()[0] == (8, 4)  # captured largest first


def test_padded_steps_match_direct_forward_and_write_only_page_zero():
    assert runner_padding_error(TorchAttentionBackend(), torch.float32, "cpu") < 1e-5


def test_mixed_steps_match_direct_forward_and_write_only_page_zero():
    assert runner_mixed_error(TorchAttentionBackend(), torch.float32, "cpu") < 1e-5


def test_mixed_buckets_pad_a_request_and_cover_every_step():
    from specserve.runtime.graph_shapes import (
        default_token_buckets,
        mixed_keys,
        mixed_request_buckets,
    )

    assert default_token_buckets(512) == (32, 64, 128, 256, 384, 512)
    assert default_token_buckets(100) == (32, 64, 100) and default_token_buckets(0) == ()
    assert mixed_request_buckets(256) == (4, 16, 64, 256, 257)
    assert mixed_request_buckets(100) == (4, 16, 64, 101)
    assert mixed_request_buckets(3) == (4,) and mixed_request_buckets(4) == (4, 5)
    requests, tokens = mixed_request_buckets(256), default_token_buckets(512)
    keys = set(mixed_keys(requests, tokens))
    runner = _runner()
    runner.mixed_requests, runner.mixed_tokens = requests, tokens
    for num_tokens in range(1, 513):
        for num_requests in range(1, min(num_tokens, 256) + 1):
            batch, padded = runner.mixed_bucket_for(num_requests, num_tokens)
            assert batch > num_requests and padded >= num_tokens and (batch, padded) in keys
    assert len(keys) == 26  # what an engine of 256 requests and 512 tokens captures
    assert runner.mixed_bucket_for(256, 513) is None and runner.mixed_bucket_for(257, 512) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_graph_replay_matches_eager(dtype):
    from specserve.layers.attention.triton_attn import TritonAttentionBackend

    err = runner_padding_error(
        TritonAttentionBackend(), dtype, "cuda", page_size=16, use_graphs=True
    )
    assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_mixed_graph_replay_matches_eager(dtype):
    from specserve.layers.attention.triton_attn import TritonAttentionBackend

    err = runner_mixed_error(TritonAttentionBackend(), dtype, "cuda", page_size=16, use_graphs=True)
    assert err < 1e-2, err


@pytest.mark.gpu
def test_gpu_capture_reports_time_and_memory():
    from specserve.layers.attention.triton_attn import TritonAttentionBackend

    runner = _runner(use_graphs=True, device="cuda", backend=TritonAttentionBackend())
    report = runner.capture()
    assert report.num_graphs == 6 and report.capture_s > 0 and report.graph_pool_bytes > 0


def test_no_collection_while_capturing_pauses_the_collector_and_restores_it():
    import gc

    from specserve.core.graph_timing import no_collection_while_capturing

    assert gc.isenabled()
    with no_collection_while_capturing():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_collection_while_capturing():
        raise RuntimeError("a failed capture")
    assert gc.isenabled()


@pytest.mark.gpu
def test_gpu_capture_survives_a_dropped_runner_collected_meanwhile():
    """A dropped runner with captured graphs, freed only by the cyclic collector (as an
    engine is): the collector must not run while the next runner captures (it destroyed the
    old graphs inside a capture on the H200, in a benchmark's third engine), and a capture
    with the collector running at every allocation still succeeds."""
    import gc

    from specserve.layers.attention.triton_attn import TritonAttentionBackend

    old = _runner(use_graphs=True, device="cuda", backend=TritonAttentionBackend())
    old.capture()
    old.cycle = old
    new = _runner(use_graphs=True, device="cuda", backend=TritonAttentionBackend())
    forward, seen = new.model.forward, []

    def watched(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            seen.append(gc.isenabled())
        return forward(*args, **kwargs)

    new.model.forward = watched
    del old
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        assert new.capture().num_graphs == 6
    finally:
        gc.set_threshold(*thresholds)
    assert seen and not any(seen)


def _recorded_buckets(plan, run) -> set[int]:
    """The row buckets of the GEMV plan keys `run()` looks up."""
    plan.asked = set()
    try:
        run()
        return {key[0] for key in plan.asked}
    finally:
        plan.asked = None


def test_steps_carrying_prefill_look_their_gemvs_up_by_rows():
    """Batch invariance (a verify row runs its decode row's kernel) is for decode and verify
    steps: a mixed step's dense layers go by its row count, as a short prompt's prefill
    would otherwise run the decode steps' 16-row tile over all its rows."""
    from specserve.core.kv_cache import KVCache
    from specserve.kernels.gemv_plan import GemvPlan
    from specserve.layers.linear import install_gemv_plan

    cfg = tiny_config()
    model = tiny_model(cfg, torch.float32, "cpu")
    plan = GemvPlan()  # no choices: every call goes to torch, each lookup recorded
    install_gemv_plan(model, plan)
    kv = KVCache(cfg, 64, 4, torch.float32, "cpu")
    tables = [kv.allocator.allocate(4) for _ in range(2)]
    runner = CudaGraphRunner(
        model, kv.layers, TorchAttentionBackend(), (1, 4), (1, 4), max_seq_len=16,
        use_graphs=False, mixed_requests=(4,), mixed_tokens=(16,),
    )  # fmt: skip
    runner.capture()
    from dataclasses import replace

    with torch.inference_mode():
        # two requests' verify rows (4 each): by request count (padded to the graph's 4)
        verify = build_meta(tables, [3, 5], [7, 9], 4, "cpu")
        ids = torch.zeros(8, dtype=torch.long)
        assert runner.can_run(verify, 8)
        assert _recorded_buckets(plan, lambda: runner.run(ids, verify)) == {4}
        # what logits projected after the replay look up: the graph's request bucket
        assert plan.step_requests == 4
        # a decode row beside a 9-token prompt (marked by the model runner): 10 rows, bucket 16
        mixed = build_meta(tables, [7, 0], [8, 9], 4, "cpu")
        mixed = replace(mixed, query_lens=[1, 9], seq_bounds=[8, 9], prefill=True)
        ids = torch.zeros(10, dtype=torch.long)
        assert runner.can_run_mixed(mixed, 10)
        assert _recorded_buckets(plan, lambda: runner.run_mixed(ids, mixed)) == {16}
        assert plan.step_requests is None  # (after a replay too: by row count)
        run = lambda: model(ids, mixed, kv.layers, runner.backend)  # noqa: E731
        assert _recorded_buckets(plan, run) == {16}  # eagerly alike
        # decode and verify rows alone go by request count, and never to a mixed graph
        # (their batch invariance): here 3 requests past the uniform graphs' buckets
        mixed.prefill = False
        assert _recorded_buckets(plan, run) == {2}
        ragged = build_meta([*tables, kv.allocator.allocate(4)], [7, 5, 2], [8, 9, 4], 4, "cpu")
        ragged = replace(ragged, query_lens=[1, 4, 2], seq_bounds=[8, 9, 4])
        assert not runner.can_run(ragged, 7) and not runner.can_run_mixed(ragged, 7)
