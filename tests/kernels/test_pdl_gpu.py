"""On a GPU: programmatic dependent launch (kernels/pdl.py) and the kernel fusions
(use_triton_ops(fuse=...)) change no bit. A tiny Llama's decode and verify steps inside CUDA
graphs, every linear through the Triton GEMV with a K split (both fusions engaged), give the
same hidden states, logits and KV cache with PDL on or off and fusion on or off; the fused
kernels equal the separate ones at Llama-3.1-8B shapes; a whole engine generates the same
tokens either way. Skipped without a GPU (`-m gpu`)."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels import pdl
from tests.support.fusion_cases import (
    gated_gemv_case,
    model_fusion_case,
    rope_gemv_case,
    set_fusions,
    silu_gemv_case,
    split_norm_case,
)

pytestmark = pytest.mark.gpu


@pytest.fixture
def restore_pdl():
    previous = pdl.is_enabled()
    yield
    pdl.set_enabled(previous)


def _graph_replay(fn):
    """fn() run once eagerly (compilation), captured in a CUDA graph and replayed; returns
    what the replay produced (the captured call's outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


def _steps_in_graphs(
    dtype, use_pdl: bool, fuse: bool, device="cuda", silu: bool = True, split_k: int = 2
) -> list[torch.Tensor]:
    """Prefill two requests eagerly, then a decode step (1 token each) and a verify step (4
    tokens each), each captured in a CUDA graph and replayed (on the CPU: run eagerly):
    hidden states, logits, KV."""
    from specserve.core.kv_cache import KVCache
    from specserve.kernels.gemv import GemvConfig
    from specserve.layers.attention.triton_attn import TritonAttentionBackend
    from specserve.layers.triton_ops import use_triton_ops
    from specserve.tuning.gemv_select import GemvPlan, use_gemv
    from tests.support.model_cases import build_meta, tiny_config, tiny_model

    pdl.set_enabled(use_pdl)
    cfg = tiny_config(
        hidden_size=256,
        intermediate_size=768,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=1000,
        max_position_embeddings=512,
    )
    model = tiny_model(cfg, dtype, device)
    use_triton_ops(model, fuse=fuse)
    if fuse and not silu:
        set_fusions(model, silu=False, split_k=True)
    use_gemv(model, plan=GemvPlan(row_buckets=(1, 2, 4, 8), default=GemvConfig(64, 128, split_k)))
    backend = TritonAttentionBackend(num_splits=2)  # the split-merge kernel too
    kv = KVCache(cfg, 64, 16, dtype, device)
    tables = [list(range(1, 9)), list(range(9, 17))]
    gen = torch.Generator().manual_seed(0)
    outs: list[torch.Tensor] = []
    with torch.inference_mode():
        for starts, ends in (([0, 0], [37, 20]), ([37, 20], [38, 21]), ([38, 21], [42, 25])):
            meta = build_meta(tables, starts, ends, 16, device)
            ids = torch.randint(cfg.vocab_size, (meta.positions.shape[0],), generator=gen)
            ids = ids.to(device)

            def step(ids=ids, meta=meta):
                hidden, _ = model(ids, meta, kv.layers, backend)
                return hidden, model.compute_logits(hidden)

            eager = starts == [0, 0] or device == "cpu"
            outs += step() if eager else _graph_replay(step)
        outs += [t.clone() for layer in kv.layers for t in layer]
    return outs


def _pdl_capable() -> bool:
    return torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_graph_steps_same_bits_with_pdl_and_fusion_on_or_off(dtype, restore_pdl):
    if not _pdl_capable():
        pytest.skip("PDL needs compute capability 9+")
    base = _steps_in_graphs(dtype, use_pdl=False, fuse=False)
    assert all(torch.isfinite(t).all() for t in base[:6])
    for use_pdl, fuse, silu in (
        (True, False, True),
        (False, True, True),
        (True, True, True),
        (True, True, False),
    ):
        outs = _steps_in_graphs(dtype, use_pdl, fuse, silu=silu)
        same = [torch.equal(a, b) for a, b in zip(outs, base)]
        assert all(same), (use_pdl, fuse, silu, same)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_graph_steps_same_bits_with_the_gate_up_epilogue(dtype, restore_pdl, monkeypatch):
    """Unsplit tiles and no SiLU prologue: every MLP computes SiLU-and-mul in its gate/up
    GEMV's epilogue, inside CUDA graphs with PDL on or off, with the bits of the unfused
    steps."""
    from specserve.layers import triton_ops

    if not _pdl_capable():
        pytest.skip("PDL needs compute capability 9+")
    base = _steps_in_graphs(dtype, use_pdl=False, fuse=False, split_k=1)
    gated_calls = []
    plain_gemv = triton_ops.gemv

    def counting(*args, gated=False, **kwargs):
        gated_calls.append(gated)
        return plain_gemv(*args, gated=gated, **kwargs)

    from specserve.kernels import gemv as gemv_module

    rope_calls = []
    plain_module_gemv = gemv_module.gemv

    def counting_rope(*args, rope=None, **kwargs):
        rope_calls.append(rope is not None)
        return plain_module_gemv(*args, rope=rope, **kwargs)

    monkeypatch.setattr(triton_ops, "gemv", counting)
    monkeypatch.setattr(gemv_module, "gemv", counting_rope)
    for use_pdl in (False, True):
        gated_calls.clear()
        rope_calls.clear()
        outs = _steps_in_graphs(dtype, use_pdl, fuse=True, silu=False, split_k=1)
        assert sum(gated_calls) >= 2 * 3, gated_calls  # 2 layers x 3 steps at least
        # the unsplit 64-column tile covers a whole head of 64: every qkv GEMV of the decode
        # and verify steps (2 layers, eager run + capture each) ran rotary and the K/V store
        assert sum(rope_calls) >= 2 * 2 * 2, rope_calls
        same = [torch.equal(a, b) for a, b in zip(outs, base)]
        assert all(same), (use_pdl, same)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_rope_epilogue_equals_separate_kernels(dtype, restore_pdl):
    """Rotary and the K/V store in the qkv GEMV's epilogue at Llama-3.1-8B's attention (32
    q heads, 8 kv heads of 128, K 4096) and SmolLM2-135M's (9 and 3 heads of 64, K 576),
    through the 16-row tiles selection proposes, at 1-16 rows and at the 33 and 64 of verify
    steps of up to 16 requests (which the 16-row bucket serves), against the plain GEMV then
    rotary_store_kv: q and both caches bit for bit, with PDL on and off."""
    from specserve.kernels.gemv import GemvConfig

    runs = [
        ((32, 8, 128, 4096), rows, cfg)
        for rows in (1, 4, 16, 33, 64)
        for cfg in (
            GemvConfig(32, 256, num_stages=4),
            GemvConfig(64, 128),
            GemvConfig(128, 128, num_warps=8),
        )
    ]
    runs += [
        ((9, 3, 64, 576), rows, cfg)
        for rows in (1, 5, 16, 64)
        for cfg in (GemvConfig(64, 64), GemvConfig(32, 128, num_stages=4))
    ]
    for use_pdl in (True, False):
        pdl.set_enabled(use_pdl)
        for (qh, kvh, hd, k), rows, cfg in runs:
            res = rope_gemv_case(cfg, rows, qh, kvh, hd, k, dtype, "cuda", seed=rows, page_size=16)
            assert res["equal"] and res["stored"] and res["err"] < 1e-2, (
                use_pdl,
                qh,
                rows,
                str(cfg),
                res,
            )


_DOWN = (4096, 14336)  # Llama-3.1-8B's down projection (N, K)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("use_pdl", [True, False])
def test_gpu_fused_kernels_equal_separate_at_8b_shape(dtype, use_pdl, restore_pdl):
    from specserve.kernels.gemv import GemvConfig

    pdl.set_enabled(use_pdl)
    n, k = _DOWN
    runs = [(rows, GemvConfig(64, 128, 4, num_stages=4)) for rows in (1, 2, 5, 16)]
    runs += [
        (33, GemvConfig(64, 128, 4, block_m=64)),
        (64, GemvConfig(64, 128, 1, block_m=64)),
        (1, GemvConfig(8, 512, use_dot=False, num_stages=2)),
        (2, GemvConfig(16, 256, 2, use_dot=False)),
    ]
    for rows, cfg in runs:
        res = silu_gemv_case(cfg, rows, n, k, dtype, "cuda", seed=rows)
        assert res["equal"] and res["err"] < 1e-2, (rows, str(cfg), res)
        if cfg.split_k > 1:
            for silu in (False, True):
                res = split_norm_case(cfg, rows, n, k, dtype, "cuda", silu=silu, seed=rows)
                assert res == {
                    "deferred": True,
                    "out": True,
                    "total": True,
                    "normed": True,
                    "reduce": True,
                }, (rows, str(cfg), silu, res)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gated_epilogue_equals_separate_kernels_at_8b_shape(dtype, restore_pdl):
    """SiLU-and-mul in the gate/up GEMV's epilogue (Llama-3.1-8B's [gate; up] 28672 x 4096),
    through the tile of half the chosen width as the MLP runs it (and through the same tile
    where that fits in shared memory), against the plain GEMV then silu_and_mul: same bits."""
    from specserve.kernels.gemv import GemvConfig

    pdl.set_enabled(True)
    n, k = 14336, 4096
    runs = [
        (1, n, GemvConfig(128, 128, block_m=16), (True, False)),
        (16, n, GemvConfig(64, 128, num_stages=4, block_m=16), (True, False)),
        (64, n, GemvConfig(128, 128, num_warps=8, num_stages=3, block_m=64), (True,)),
        (64, n, GemvConfig(128, 64, num_stages=4, block_m=64), (True,)),
        (64, n, GemvConfig(256, 64, num_warps=8, num_stages=3, block_m=64), (True,)),
        (33, n, GemvConfig(128, 128, num_warps=8, num_stages=3, block_m=64, tma=True), (True,)),
        # N off every tile: the last gate tile runs into the up rows, the last up tile
        # past the weight
        (3, 1000, GemvConfig(64, 128, block_m=16), (True, False)),
        (64, 1000, GemvConfig(128, 64, num_stages=4, block_m=64, tma=True), (True,)),
    ]
    for rows, cols, cfg, halves in runs:
        for half in halves:
            res = gated_gemv_case(cfg, rows, cols, k, dtype, "cuda", seed=rows, half=half)
            assert res["equal"] and res["err"] < 1e-2, (rows, cols, str(cfg), half, res)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_model_gated_mlp_equals_unfused_on_triton_attention(dtype):
    from specserve.kernels.gemv import GemvConfig
    from specserve.layers.attention.triton_attn import TritonAttentionBackend

    res = model_fusion_case(
        dtype, "cuda", GemvConfig(32, 32), TritonAttentionBackend(), fused_choice=False
    )
    assert res["equal"] and (res["gated_gemvs"], res["silu_gemvs"]) == (6, 0), res
    assert res["err"] < 3e-2, res


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_model_fused_equals_unfused_on_triton_attention(dtype):
    from specserve.kernels.gemv import GemvConfig
    from specserve.layers.attention.triton_attn import TritonAttentionBackend

    res = model_fusion_case(dtype, "cuda", GemvConfig(16, 32, 2), TritonAttentionBackend())
    assert res["equal"] and res["fused_norms"] == 12, res  # o_proj and down, 2 layers x 3
    assert res["err"] < 3e-2, res


def test_gpu_engine_tokens_same_with_pdl_and_fusion_off(tiny_llama, restore_pdl):
    from specserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 13, 2, 7], list(range(3, 40)), [11] * 20]
    outs = {}
    for off in (False, True):
        llm = LLM(
            str(tiny_llama),
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=4,
            disable_pdl=off,
            disable_fusion=off,
        )
        assert llm.engine.kernel_options.pdl is not off
        outs[off] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
    assert outs[False] == outs[True]


def test_gpu_selection_times_the_fused_down_projection():
    from specserve.layers.triton_ops import use_triton_ops
    from specserve.tuning import gemv_select
    from specserve.tuning.gemv_select import GemvSelector, use_gemv
    from tests.support.model_cases import tiny_config, tiny_model
    from tests.support.triton_cases import rel_err

    gemv_select._MEASURED.clear()  # engines of earlier tests may have measured these shapes
    cfg = tiny_config(hidden_size=256, intermediate_size=1024, vocab_size=1000, head_dim=64)
    model = tiny_model(cfg, torch.bfloat16, "cuda")
    x = torch.randn(3, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    ref = model.model.layers[0].mlp(x)
    use_triton_ops(model)
    selector = GemvSelector(budget_s=30.0, row_buckets=(1, 2, 4, 8, 16))
    plan = use_gemv(model, selector)
    fused = [r for r in plan.summary() if r.get("fusion") == "silu+split_k"]
    assert len(fused) == 5 and selector.skipped == 0, plan.summary()
    assert (fused[0]["n"], fused[0]["k"]) == (cfg.hidden_size, cfg.intermediate_size)
    assert len({r["kernel"] for r in fused}) == 1  # one choice over the small buckets
    out = model.model.layers[0].mlp(x, defer_reduce=False)
    assert rel_err(out, ref) < 2e-2
