"""Kernel fusions that must not change a bit (tests/support/fusion_cases.py), through the Triton
interpreter on the CPU in one subprocess (fp16/fp32 for the matrix-unit path, whose bf16
tl.dot the interpreter computes wrongly; bf16 too on the CUDA-core path): the GEMV's SiLU
prologue, SiLU-and-mul as the gate/up GEMV's epilogue, the split-K pass fused with the
residual add and RMSNorm, and a tiny Llama with use_triton_ops(fuse=True) against
fuse=False. The same cases run on a GPU in tests/kernels/test_pdl_gpu.py."""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest
import torch

from tests.support.interpreter_run import record_case

TOL = {"bfloat16": 8e-3, "float32": 2e-6, "float16": 1e-3}  # bfloat16 first: names hold both


def _configs() -> dict:
    from specserve.kernels.gemv import GemvConfig

    return {
        "dot": GemvConfig(block_n=16, block_k=32),
        "dot-split3": GemvConfig(block_n=16, block_k=32, split_k=3),
        "dot32": GemvConfig(block_n=32, block_k=32),
        "dot32-tma": GemvConfig(block_n=32, block_k=64, block_m=32, tma=True),
        "fma": GemvConfig(block_n=8, block_k=64, use_dot=False),
        "fma-split2": GemvConfig(block_n=8, block_k=64, split_k=2, use_dot=False),
    }


def _silu_cases() -> dict[str, tuple]:
    """name -> (config name, rows, n, k, dtype, bias); K 200 is off the block sizes."""
    cases = {}
    for cfg in ("dot", "dot-split3"):
        for dtype in ("float16", "float32"):
            for rows in (1, 3, 17):  # 17: two row blocks of 16
                cases[f"silu-{cfg}-{dtype}-m{rows}"] = (cfg, rows, 72, 200, dtype, False)
        cases[f"silu-{cfg}-float16-bias-k256"] = (cfg, 2, 40, 256, "float16", True)
    for cfg in ("fma", "fma-split2"):
        for dtype in ("float16", "float32", "bfloat16"):
            cases[f"silu-{cfg}-{dtype}-m2"] = (cfg, 2, 72, 200, dtype, cfg == "fma")
    return cases


def _gated_cases() -> dict[str, tuple]:
    """name -> (config name, rows, n, k, dtype, bias, half); N 72 is not a block multiple."""
    cases = {}
    for dtype in ("float16", "float32"):
        for rows in (1, 3, 17):
            cases[f"gated-dot-{dtype}-m{rows}"] = ("dot", rows, 72, 200, dtype, False, False)
        cases[f"gated-dot-{dtype}-half-m5"] = ("dot32", 5, 72, 200, dtype, False, True)
        # tiles through a descriptor: the last gate tile runs into the up rows, the last up
        # tile past the weight (zeros)
        cases[f"gated-tma-{dtype}-half-m33"] = ("dot32-tma", 33, 72, 200, dtype, True, True)
    cases["gated-dot-float16-bias-k256"] = ("dot", 2, 40, 256, "float16", True, False)
    for dtype in ("float16", "float32"):  # bf16: the interpreter's own SiLU is off by ~1%
        cases[f"gated-fma-{dtype}-m2"] = ("fma", 2, 72, 200, dtype, True, False)
    return cases


def _rope_cases() -> dict[str, tuple]:
    """name -> (config name, rows, q heads, kv heads, head dim, k, dtype, bias): tiles of a
    whole head (dot32 at head dim 32) and of a quarter head; K 200 is off the block sizes."""
    cases = {}
    for dtype in ("float16", "float32"):
        for rows in (1, 3, 17):
            cases[f"rope-dot-{dtype}-m{rows}"] = ("dot", rows, 4, 2, 64, 200, dtype, False)
        cases[f"rope-dot32-{dtype}-m5-bias"] = ("dot32", 5, 2, 1, 32, 96, dtype, True)
    return cases


def _norm_cases() -> dict[str, tuple]:
    """name -> (config name, rows, n, k, dtype, bias, silu); N 72 is not a power of 2."""
    cases = {}
    for dtype in ("float16", "float32"):
        for rows in (1, 5):
            cases[f"norm-dot-split3-{dtype}-m{rows}"] = (
                "dot-split3",
                rows,
                72,
                200,
                dtype,
                False,
                False,
            )
        cases[f"norm-dot-split3-{dtype}-silu-bias"] = ("dot-split3", 3, 64, 200, dtype, True, True)
    cases["norm-fma-split2-bfloat16-silu"] = ("fma-split2", 2, 72, 200, "bfloat16", False, True)
    return cases


def run_cases() -> dict:
    from specserve.kernels.gemv import GemvConfig
    from tests.support.fusion_cases import (
        gated_gemv_case,
        model_fusion_case,
        rope_gemv_case,
        silu_gemv_case,
        split_norm_case,
    )

    configs = _configs()
    results: dict = {}
    record = functools.partial(record_case, results)

    for name, (cfg, rows, n, k, dtype, bias) in _silu_cases().items():
        record(
            name,
            silu_gemv_case,
            configs[cfg],
            rows,
            n,
            k,
            getattr(torch, dtype),
            "cpu",
            bias,
            seed=len(name),
        )
    for name, (cfg, rows, n, k, dtype, bias, half) in _gated_cases().items():
        record(
            name,
            gated_gemv_case,
            configs[cfg],
            rows,
            n,
            k,
            getattr(torch, dtype),
            "cpu",
            bias,
            seed=len(name),
            half=half,
        )
    for name, (cfg, rows, qh, kvh, hd, k, dtype, bias) in _rope_cases().items():
        record(
            name,
            rope_gemv_case,
            configs[cfg],
            rows,
            qh,
            kvh,
            hd,
            k,
            getattr(torch, dtype),
            "cpu",
            bias,
            seed=len(name),
        )
    for name, (cfg, rows, n, k, dtype, bias, silu) in _norm_cases().items():
        record(
            name,
            split_norm_case,
            configs[cfg],
            rows,
            n,
            k,
            getattr(torch, dtype),
            "cpu",
            bias,
            silu,
            seed=len(name),
        )
    split = GemvConfig(block_n=16, block_k=32, split_k=2)
    for dtype in ("float32", "float16"):
        record(f"model-{dtype}", model_fusion_case, getattr(torch, dtype), "cpu", split)
    record("model-float16-split-k-only", model_fusion_case, torch.float16, "cpu", split, silu=False)
    record(
        "model-float16-fused-slower",
        model_fusion_case,
        torch.float16,
        "cpu",
        split,
        fused_choice=False,
    )
    for dtype in ("float32", "float16"):  # unsplit: SiLU-and-mul in the gate/up epilogue
        record(
            f"gated-model-{dtype}",
            model_fusion_case,
            getattr(torch, dtype),
            "cpu",
            GemvConfig(block_n=32, block_k=32),
            fused_choice=False,
        )
    from specserve.layers.attention.triton_attn import TritonAttentionBackend

    for dtype in ("float32", "float16"):  # tiles of one head: rotary + K/V store in qkv
        record(
            f"rope-model-{dtype}",
            model_fusion_case,
            getattr(torch, dtype),
            "cpu",
            GemvConfig(block_n=16, block_k=32),
            TritonAttentionBackend(),
        )
    return results


# the interpreter run (module, seconds idle) whose results the `interpreter_results` fixture
# gives this file's tests (conftest.py; started in the background: tests/support/interpreter_run.py)
INTERPRETER = ("tests.kernels.test_fusion", 600)


def _names(cases) -> list[str]:
    try:
        return sorted(cases())
    except ImportError:  # no triton: the fixture skips
        return ["triton-missing"]


@pytest.mark.parametrize("name", _names(_silu_cases) + _names(_gated_cases))
def test_interpreter_silu_fused_equals_separate_kernels(name, interpreter_results):
    """SiLU-and-mul as the GEMV's prologue (silu-*) or as the gate/up GEMV's epilogue
    (gated-*) against the separate kernels."""
    res = interpreter_results[name]
    assert isinstance(res, dict), f"{name} raised {res}"
    assert res["equal"], f"{name}: the fused GEMV differs from GEMV and silu_and_mul apart"
    dtype = next(d for d in TOL if d in name)
    assert res["err"] <= TOL[dtype], res  # and both are right


@pytest.mark.parametrize("name", _names(_rope_cases))
def test_interpreter_rope_epilogue_equals_gemv_then_rotary_store(name, interpreter_results):
    """Rotary and the K/V store as the qkv GEMV's epilogue against the plain GEMV followed by
    the rotary + KV-store kernel: q and both caches bit for bit, only the rows' slots
    written (a slot of -1: none)."""
    res = interpreter_results[name]
    assert isinstance(res, dict), f"{name} raised {res}"
    assert res["equal"] and res["stored"], res
    dtype = next(d for d in TOL if d in name)
    assert res["err"] <= TOL[dtype], res


@pytest.mark.parametrize("name", _names(_norm_cases))
def test_interpreter_split_k_pass_fused_into_add_rms_norm(name, interpreter_results):
    res = interpreter_results[name]
    assert isinstance(res, dict), f"{name} raised {res}"
    assert res == {"deferred": True, "out": True, "total": True, "normed": True, "reduce": True}, (
        name
    )


@pytest.mark.parametrize(
    "case", ["float32", "float16", "float16-split-k-only", "float16-fused-slower"]
)
def test_interpreter_model_fused_equals_unfused(case, interpreter_results):
    res = interpreter_results[f"model-{case}"]
    assert isinstance(res, dict), res
    assert res["equal"], res
    # every layer's o_proj and down projection (2 layers, 3 steps) reached the next norm
    # unreduced, the down projection with its SiLU as the GEMV's prologue unless that
    # fusion is off or measured slower
    assert res["fused_norms"] == 2 * 2 * 3, res
    no_silu = "split-k-only" in case or "slower" in case
    assert res["silu_gemvs"] == (0 if no_silu else 2 * 3), res
    assert res["gated_gemvs"] == 0, res  # a K split: gate/up keeps its plain GEMV
    assert res["err"] <= 10 * TOL[case.split("-")[0]], res


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_interpreter_model_gated_mlp_equals_unfused(dtype, interpreter_results):
    res = interpreter_results[f"gated-model-{dtype}"]
    assert isinstance(res, dict), res
    assert res["equal"], res
    # unsplit, fused down projection measured slower: every MLP (2 layers, 3 steps) ran
    # SiLU-and-mul in its gate/up GEMV, none as the down projection's prologue
    assert (res["gated_gemvs"], res["silu_gemvs"], res["fused_norms"]) == (2 * 3, 0, 0), res
    assert res["err"] <= 10 * TOL[dtype], res


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_interpreter_model_rope_in_qkv_equals_unfused(dtype, interpreter_results):
    res = interpreter_results[f"rope-model-{dtype}"]
    assert isinstance(res, dict), res
    assert res["equal"], res  # hidden states, logits and the whole KV cache
    # on the Triton attention backend with tiles of one head (16 columns): every layer's
    # qkv GEMV (2 layers, 3 steps) rotated and stored K/V itself; the unsplit down
    # projections took the SiLU prologue
    assert (res["rope_gemvs"], res["silu_gemvs"]) == (2 * 3, 2 * 3), res
    assert res["err"] <= 10 * TOL[dtype], res


# ---- which down projections fuse, and how the selection times them (no kernel runs) ----
def test_fused_projections_report_their_fusions():
    from specserve.layers.linear import NORM_FUSION, fused_projections
    from specserve.layers.triton_ops import use_triton_ops
    from tests.support.fusion_cases import set_fusions
    from tests.support.model_cases import tiny_config, tiny_model

    cfg = tiny_config()
    model = tiny_model(cfg, torch.float16, "cpu")
    down = (cfg.hidden_size, cfg.intermediate_size, torch.float16)
    o_proj = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, torch.float16)
    assert fused_projections(model) == {}  # plain modules
    use_triton_ops(model, fuse=False)
    assert fused_projections(model) == {}
    use_triton_ops(model)
    assert fused_projections(model) == {down: "silu+split_k", o_proj: NORM_FUSION}
    set_fusions(model, silu=False, split_k=True)
    assert fused_projections(model) == {down: "split_k", o_proj: NORM_FUSION}
    use_triton_ops(model, enable=False)
    assert fused_projections(model) == {}
    square = tiny_model(tiny_config(intermediate_size=64), torch.float16, "cpu")
    use_triton_ops(square)  # o_proj and down share a shape: the down projection's fusion
    assert fused_projections(square) == {o_proj: "silu+split_k"}


def test_gated_projections_and_their_epilogue_tiles():
    from specserve.kernels.gemv import GemvConfig
    from specserve.kernels.gemv_configs import gated_config
    from specserve.layers.linear import gated_projections
    from specserve.layers.triton_ops import use_triton_ops
    from tests.support.fusion_cases import set_fusions
    from tests.support.model_cases import tiny_config, tiny_model

    cfg = tiny_config()
    model = tiny_model(cfg, torch.float16, "cpu")
    gate_up = (2 * cfg.intermediate_size, cfg.hidden_size, torch.float16)
    assert gated_projections(model) == set()  # plain modules
    use_triton_ops(model, fuse=False)
    assert gated_projections(model) == set()
    use_triton_ops(model)
    assert gated_projections(model) == {gate_up}
    set_fusions(model, silu=True, split_k=True, gate=False)
    assert gated_projections(model) == set()
    # the tile of half the width where the epilogue applies, else None
    assert gated_config(GemvConfig(128, 64, num_stages=4, block_m=64)) == GemvConfig(
        64, 64, num_stages=4, block_m=64
    )
    assert gated_config(GemvConfig(32, 256, tma=True)) == GemvConfig(16, 256, tma=True)
    for no in (
        None,
        GemvConfig(64, 128, split_k=2),
        GemvConfig(16, 256),
        GemvConfig(8, 512, use_dot=False),
    ):
        assert gated_config(no) is None


def test_selection_compiles_the_gated_variants_of_gate_up_candidates():
    from specserve.kernels.gemv import GemvConfig
    from specserve.tuning.gemv_select import compile_tasks

    gate_up, down = (256, 64, torch.float16), (64, 128, torch.float16)
    shapes = {gate_up: [torch.zeros(256, 64)], down: [torch.zeros(64, 128)]}
    tiles = [GemvConfig(64, 64), GemvConfig(16, 64), GemvConfig(64, 64, split_k=2)]
    jobs = [(1, tiles), (4, tiles)]  # the same variants serve both buckets
    plain = compile_tasks({gate_up: jobs, (*down, "silu+split_k"): [(1, tiles[:1])]}, shapes)
    assert sorted(t[3] or "plain" for t in plain.values()) == ["plain"] * 3 + ["silu"]
    both = compile_tasks({gate_up: jobs}, shapes, {gate_up: jobs})
    gated = [t for t in both.values() if t[3] == "gated"]
    # only the unsplit tile of width >= 32 has an epilogue variant: its half, once
    assert [(t[0], t[3]) for t in gated] == [(GemvConfig(32, 64), "gated")]
    assert gated[0][2] is shapes[gate_up][0]  # compiled on a [gate; up] weight


def test_selection_compiles_one_variant_per_prefetch_under_pdl():
    """Under PDL the GEMV's L2 prefetch (lines per program, from the shape) is a compile-time
    constant: one tile on two shapes is two variants to compile, without PDL one."""
    from specserve.kernels.gemv import GemvConfig, call_prefetch
    from specserve.tuning.gemv_select import compile_tasks

    o, gate_up = (4096, 4096, torch.bfloat16), (28672, 4096, torch.bfloat16)
    shapes = {o: [torch.zeros(1, 1)], gate_up: [torch.zeros(1, 1)]}
    cfg = GemvConfig(64, 128, num_stages=4)
    jobs = [(1, [cfg])]
    assert call_prefetch(cfg, 4096, 4096, 2) == 16 and call_prefetch(cfg, 28672, 4096, 2) == 2
    assert len(compile_tasks({o: jobs, gate_up: jobs}, shapes)) == 1
    assert len(compile_tasks({o: jobs, gate_up: jobs}, shapes, pdl_on=True)) == 2
    # the epilogue streams both halves: twice the programs, its own prefetch
    gated = compile_tasks(
        {}, shapes, {gate_up: [(1, [GemvConfig(128, 128, num_stages=4)])]}, pdl_on=True
    )
    (key,) = gated
    assert key[-3] == call_prefetch(cfg, 14336, 4096, 2, gated=True) == 2  # cfg: the half tile
    # a shape whose layers have a bias: each variant also with one (the task's last item)
    both = compile_tasks({o: jobs}, shapes, pdl_on=True, biased=frozenset({o}))
    assert sorted(task[-1] for task in both.values()) == [False, True]


def test_selection_compiles_the_rope_variants_of_qkv_candidates_that_fit():
    """Only unsplit matrix-unit pointer tiles of up to 16 rows within one head, on the
    data-parallel schedule, run the rope epilogue (`rope_fits`);
    selection compiles their rope variants, one per tile and head layout, on a qkv weight;
    rope_projections finds the qkv shapes of attention blocks that fuse."""
    from specserve.kernels.gemv import GemvConfig, rope_fits
    from specserve.layers.linear import rope_projections
    from specserve.layers.triton_ops import use_triton_ops
    from specserve.tuning.gemv_select import compile_tasks
    from tests.support.model_cases import tiny_config, tiny_model

    assert rope_fits(GemvConfig(64, 128), 128, 4096)
    assert not rope_fits(GemvConfig(128, 64, block_m=64), 128, 4096)  # measured slower
    assert not rope_fits(GemvConfig(64, 128, block_m=32), 128, 4096)
    assert not rope_fits(GemvConfig(16, 256, use_dot=False), 128, 4096)  # an ulp off on GPUs
    assert not rope_fits(GemvConfig(64, 128, stream_k=True), 128, 4096)
    assert not rope_fits(GemvConfig(256, 64), 128, 4096)  # wider than a head
    assert not rope_fits(GemvConfig(64, 128, tma=True), 128, 4096)  # contiguous tile rows
    assert not rope_fits(GemvConfig(64, 128, split_k=2), 128, 4096)
    assert rope_fits(GemvConfig(64, 128, split_k=2), 128, 128)  # a split of one slice
    assert not rope_fits(GemvConfig(48, 128), 64, 4096)  # does not divide the head
    qkv = (6144, 4096, torch.bfloat16)
    shapes = {qkv: [torch.zeros(6144, 4096, dtype=torch.bfloat16)]}
    tiles = [
        GemvConfig(64, 128),
        GemvConfig(256, 64),
        GemvConfig(64, 128, split_k=2),
        GemvConfig(32, 256, num_stages=4),
        GemvConfig(64, 128, block_m=64),
    ]
    jobs = [(1, tiles), (4, tiles)]
    tasks = compile_tasks({qkv: jobs}, shapes, rope_jobs={qkv: ((32, 8, 128), jobs)})
    rope = [t for t in tasks.values() if isinstance(t[3], tuple)]
    assert sorted(str(t[0]) for t in rope) == sorted(str(c) for c in (tiles[0], tiles[3]))
    assert all(t[3] == ("rope", (32, 8, 128)) and t[2] is shapes[qkv][0] for t in rope)
    assert len(tasks) == len(tiles) + 2  # the plain variants too

    cfg = tiny_config()
    model = tiny_model(cfg, torch.float16, "cpu")
    key = ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size, torch.float16)
    assert rope_projections(model) == {}
    use_triton_ops(model)
    assert rope_projections(model) == {key: (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)}
    use_triton_ops(model, fuse=False)
    assert rope_projections(model) == {}
    qk_norm = tiny_model(tiny_config(qk_norm=True), torch.float16, "cpu")
    use_triton_ops(qk_norm)  # q/k norms come before rotary: no epilogue
    assert rope_projections(qk_norm) == {}


def test_plan_serves_a_fused_down_projection_by_its_own_measurement():
    from specserve.kernels.gemv import GemvConfig
    from specserve.tuning.gemv_select import GemvChoice, GemvPlan

    plain, fused = GemvConfig(64, 128), GemvConfig(64, 128, 4)
    key = (96, 64, torch.float16)
    plan = GemvPlan(
        {
            (1, *key): GemvChoice(plain, 10.0, 9.0, 3),
            (1, *key, "silu+split_k"): GemvChoice(fused, 12.0, 8.0, 3),
            (2, *key): GemvChoice(plain, 10.0, 9.0, 3),
            (2, *key, "silu+split_k"): GemvChoice(None, 12.0, 12.0, 3),
        },
        row_buckets=(1, 2),
    )
    assert plan.config_for(1, *key) == plain  # a plain call of the shape
    assert plan.config_for(1, *key, "silu+split_k") == fused
    assert plan.config_for(2, *key, "silu+split_k") is None  # fused measured slower: torch
    assert plan.config_for(1, *key, "split_k") == plain  # not measured: the plain choice
    assert GemvPlan(default=fused).config_for(3, *key, "silu") == fused  # tests force it
    assert [r.get("fusion") for r in plan.summary()] == [None, "silu+split_k"] * 2


def test_selection_times_a_fused_down_projection_against_the_unfused_path(monkeypatch):
    from specserve.tuning.gemv_select import ROW_BUCKETS, GemvSelector, bucket_candidates

    selector = GemvSelector()
    seen = []

    def fake(cfg, x, rotation, *fusion):  # fused Triton saves 3 us; plain Triton loses by 1
        seen.append((x.shape[1], fusion))
        return (10.0 if cfg is None else (7.0 if fusion else 11.0)), 0.0  # (us, first call s)

    monkeypatch.setattr(selector, "_measure", fake)
    jobs = bucket_candidates(ROW_BUCKETS, 96, 64, num_sms=132)
    for fusion in ((), ("silu+split_k",), ("norm",)):
        selector._measure_shape(96, 64, torch.float16, jobs, [torch.zeros(96, 64)], 1e18, *fusion)
    assert {cols for cols, fusion in seen if fusion == ("silu+split_k",)} == {128}  # [gate|up]
    assert {cols for cols, fusion in seen if fusion != ("silu+split_k",)} == {64}  # o_proj too
    for b in ROW_BUCKETS:
        assert selector.measured[(b, 96, 64, torch.float16)].config is None
        for fusion in ("silu+split_k", "norm"):
            assert selector.measured[(b, 96, 64, torch.float16, fusion)].config is not None


if __name__ == "__main__":  # the interpreter run (TRITON_INTERPRET=1), see the fixture
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.stdout.write("\n" + json.dumps(run_cases()) + "\n")
