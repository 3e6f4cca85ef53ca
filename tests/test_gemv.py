"""The Triton GEMV (layers/gemv.py), its start-up selection (gemv_select.py) and the linear
layers' switch to it (linear.use_gemv).

On the CPU the kernel runs through the Triton interpreter in one subprocess (fp16/fp32 for
the matrix-unit path, whose bf16 tl.dot the interpreter computes wrongly; bf16 too for the
CUDA-core path): M = 1..8, N and K off the block sizes, K splits, bias, and a tiny model's
decode steps with every linear forced through the kernel, and rows that do not depend on M for
the configurations row buckets 1..16 share. The plan, the selector's choice (a fake timer) and
the module switch are tested directly. On a GPU (`-m gpu`): every start-up candidate at the 8B
and SmolLM2 shapes in bf16/fp16 against torch, bitwise reproducibility, CUDA-graph capture, the
selector.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from torch import nn

from tests.interpreter_run import interpreter_results as run_interpreter
from tests.triton_cases import rel_err

TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def gemv_error(config, rows: int, n: int, k: int, dtype, device, bias=False, seed=0):
    """Relative error of gemv against a float64 reference; inf when two calls differ."""
    from specserve.layers.gemv import gemv

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype=dtype, device=device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype=dtype, device=device)
    b = torch.randn(n, generator=gen).to(dtype=dtype, device=device) if bias else None
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    out = gemv(x, w, b, config)
    if not torch.equal(out, gemv(x, w, b, config)) or out.dtype != dtype:
        return float("inf")
    return rel_err(out, ref)


def _interpreter_cases() -> dict[str, tuple]:
    from specserve.layers.gemv import GemvConfig

    dot = GemvConfig(block_n=32, block_k=64)
    cases: dict[str, tuple] = {}
    for n, k in ((100, 300), (96, 576), (64, 128)):
        for rows in range(1, 9):
            cases[f"dot-float16-{n}x{k}-m{rows}"] = (dot, rows, n, k, "float16", False)
        cases[f"dot-float32-{n}x{k}-m3"] = (dot, 3, n, k, "float32", False)
    for split in (2, 3):
        cfg = GemvConfig(block_n=16, block_k=32, split_k=split)
        for rows in (1, 5, 8):
            cases[f"dot-split{split}-float16-m{rows}"] = (cfg, rows, 72, 200, "float16", False)
        cases[f"dot-split{split}-bias-float32-m2"] = (cfg, 2, 72, 200, "float32", True)
    cases["dot-bias-float16-m4"] = (dot, 4, 100, 300, "float16", True)
    # the skinny-GEMM row blocks: one block of 16/32/64 rows, or several blocks of 16
    for bm, rows_list in ((16, (12, 16, 17, 40)), (32, (17, 32)), (64, (33, 64))):
        cfg = GemvConfig(block_n=16, block_k=64, block_m=bm)
        for rows in rows_list:
            cases[f"dot-m{bm}-float16-m{rows}"] = (cfg, rows, 72, 200, "float16", False)
        split = GemvConfig(block_n=32, block_k=32, split_k=3, block_m=bm)
        cases[f"dot-m{bm}-split3-bias-float16-m{rows_list[-1]}"] = (
            split, rows_list[-1], 40, 256, "float16", True)  # fmt: skip
    for dtype in ("float16", "float32", "bfloat16"):
        for rows in (1, 2):
            fma = GemvConfig(block_n=8, block_k=64, use_dot=False)
            cases[f"fma-{dtype}-m{rows}"] = (fma, rows, 100, 300, dtype, False)
            fma_split = GemvConfig(block_n=16, block_k=32, split_k=3, use_dot=False)
            cases[f"fma-split3-{dtype}-m{rows}"] = (fma_split, rows, 40, 256, dtype, rows == 2)
    return cases


def model_decode_errors(dtype, device, config, seed=0) -> dict[str, float]:
    """A tiny Llama's hidden states and logits over steps of 1..8 tokens (and one of 12, past
    the plan's largest bucket: torch) with every linear through `config`, against plain
    torch modules."""
    from specserve.engine.kv_cache import KVCache
    from specserve.layers.attention import TorchAttentionBackend
    from specserve.layers.gemv_select import GemvPlan
    from specserve.layers.linear import use_gemv
    from tests.model_cases import build_meta, tiny_config, tiny_model

    cfg = tiny_config()
    model = tiny_model(cfg, dtype, device, seed)
    kv = [KVCache(cfg, 9, 4, dtype, device) for _ in "ab"]
    gen = torch.Generator().manual_seed(seed)
    errs = {}
    with torch.inference_mode():
        for q in (1, 3, 8, 12):
            meta = build_meta([[1, 2, 3, 4]], [0], [q], 4, device)  # every read key written
            ids = torch.randint(cfg.vocab_size, (q,), generator=gen).to(device)
            use_gemv(model, enable=False)
            ref, _ = model(ids, meta, kv[0].layers, TorchAttentionBackend())
            ref_logits = model.compute_logits(ref)
            use_gemv(model, plan=GemvPlan(row_buckets=(1, 2, 4, 8), default=config))
            out, _ = model(ids, meta, kv[1].layers, TorchAttentionBackend())
            logits = model.compute_logits(out)
            errs[f"q{q}"] = max(rel_err(out, ref), rel_err(logits, ref_logits))
            if q > 8:  # beyond the largest bucket: torch itself, bit for bit
                errs[f"q{q}"] = float(not torch.equal(logits, ref_logits))
    return errs


def row_invariance_failures(dtype, n: int = 72, k: int = 600) -> list[str]:
    """The configurations the selector may share across row buckets 1..16 (a long K: a K
    split among them; K off the block sizes) whose rows for M = 1 or 4 differ, bit for bit,
    from the same rows computed with M = 16 (or M = 1 from M = 4)."""
    from specserve.layers.gemv import gemv
    from specserve.layers.gemv_select import bucket_candidates

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    (_, shared), *_ = bucket_candidates((1,), n, k, num_sms=132)
    assert any(c.split_k > 1 for c in shared)
    failures = []
    for cfg in shared:
        out = {m: gemv(x[:m], w, None, cfg) for m in (1, 4, 16)}
        if not (torch.equal(out[1], out[4][:1]) and torch.equal(out[4], out[16][:4])):
            failures.append(str(cfg))
    return failures


def run_cases() -> dict:
    from specserve.layers.gemv import GemvConfig

    results: dict = {}
    for name, (cfg, rows, n, k, dtype, bias) in _interpreter_cases().items():
        try:
            results[name] = gemv_error(cfg, rows, n, k, getattr(torch, dtype), "cpu", bias,
                                       seed=len(name))  # fmt: skip
        except Exception as e:  # reported per case by the test
            results[name] = f"{type(e).__name__}: {e}"
    for dtype in ("float32", "float16"):
        try:
            results[f"rows-invariant-{dtype}"] = row_invariance_failures(getattr(torch, dtype))
        except Exception as e:
            results[f"rows-invariant-{dtype}"] = f"{type(e).__name__}: {e}"
        cfg = GemvConfig(block_n=16, block_k=32, split_k=2)
        try:
            results[f"model-{dtype}"] = model_decode_errors(getattr(torch, dtype), "cpu", cfg)
        except Exception as e:
            results[f"model-{dtype}"] = f"{type(e).__name__}: {e}"
    return results


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return run_interpreter("tests.test_gemv")


def _case_names() -> list[str]:
    try:
        return sorted(_interpreter_cases())
    except ImportError:  # no triton: the fixture skips
        return ["triton-missing"]


@pytest.mark.parametrize("name", _case_names())
def test_interpreter_gemv_matches_reference(name, interpreter_results):
    err = interpreter_results[name]
    assert isinstance(err, float), f"{name} raised {err}"
    dtype = getattr(torch, next(d for d in ("bfloat16", "float16", "float32") if d in name))
    assert err <= TOL[dtype], f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_interpreter_model_decode_through_gemv(dtype, interpreter_results):
    errs = interpreter_results[f"model-{dtype}"]
    assert isinstance(errs, dict), errs
    for q in ("q1", "q3", "q8"):
        assert errs[q] <= 10 * TOL[getattr(torch, dtype)], errs
    assert errs["q12"] == 0.0, errs  # 12 rows: the plan hands it to torch


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_interpreter_shared_configs_give_rows_independent_of_m(dtype, interpreter_results):
    assert interpreter_results[f"rows-invariant-{dtype}"] == []


# ---- the plan and the module switch (no kernel runs) -------------------------------------
def test_plan_buckets_rows_and_falls_back_to_torch():
    from specserve.layers.gemv import GemvConfig
    from specserve.layers.gemv_select import ROW_BUCKETS, GemvChoice, GemvPlan, GemvSelector

    cfg = GemvConfig(block_n=64, block_k=128, split_k=4)
    choices = {(4, 96, 64, torch.float16): GemvChoice(cfg, 10.0, 8.0, 5),
               (1, 96, 64, torch.float16): GemvChoice(None, 10.0, 10.0, 5)}  # fmt: skip
    plan = GemvPlan(choices, row_buckets=(1, 2, 4, 8))
    assert [plan.config_for(r, 96, 64, torch.float16) for r in (3, 4)] == [cfg, cfg]
    assert plan.config_for(1, 96, 64, torch.float16) is None  # torch measured faster
    assert plan.config_for(2, 96, 64, torch.float16) is None  # not measured
    assert plan.config_for(4, 96, 64, torch.bfloat16) is None
    assert plan.config_for(9, 96, 64, torch.float16) is None  # beyond the largest bucket
    assert GemvPlan(default=cfg).config_for(0, 96, 64, torch.float16) is None
    rows = plan.summary()
    assert {r["kernel"] for r in rows} == {"torch", str(cfg)} and rows[1]["speedup"] == 1.25
    x, w = torch.randn(2, 64), torch.randn(96, 64)  # fp32: the plan serves it with torch
    assert torch.equal(plan.linear(x, w), nn.functional.linear(x, w))
    with pytest.raises(ValueError):
        GemvPlan(row_buckets=(1, 128))
    assert GemvSelector(max_rows=5).row_buckets == (1, 2, 4, 8)  # only what steps reach
    assert GemvSelector(max_rows=64).row_buckets == GemvSelector().row_buckets == ROW_BUCKETS
    fma = GemvConfig(block_n=8, block_k=64, use_dot=False)  # serves at most 8 rows
    assert GemvPlan(row_buckets=(1, 64), default=fma).config_for(20, 96, 64, torch.float16) is None


def test_use_gemv_switches_modules_and_back_without_touching_weights():
    from specserve.layers.gemv_select import GemvPlan, GemvSelector
    from specserve.layers.linear import GemvLinear, GemvMergedLinear, MergedLinear, use_gemv
    from tests.model_cases import tiny_config, tiny_model

    model = tiny_model(tiny_config(), torch.float32, "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = use_gemv(model, GemvSelector())  # on the CPU: measured nothing, torch everywhere
    assert isinstance(plan, GemvPlan) and plan.choices == {}
    assert model.gemv_plan is plan
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, (GemvLinear, GemvMergedLinear)) for m in linears)
    assert all(m.gemv_plan is plan for m in linears)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, MergedLinear)
    assert model.model.layers[0].self_attn.qkv_proj.shard_rows()  # still a MergedLinear
    x = torch.randn(3, model.config.hidden_size)
    assert torch.equal(model.compute_logits(x), x @ model.lm_head_weight.T)
    use_gemv(model, enable=False)
    assert model.gemv_plan is None
    assert all(type(m) in (nn.Linear, MergedLinear) for m in model.modules()
               if isinstance(m, nn.Linear))  # fmt: skip
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in after)


def test_gemv_weights_groups_shapes_and_the_tied_logits_projection():
    from specserve.layers.linear import gemv_weights
    from tests.model_cases import tiny_config, tiny_model

    cfg = tiny_config(tie_word_embeddings=True)
    model = tiny_model(cfg, torch.float32, "cpu")
    groups = gemv_weights(model)
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h, torch.float32)
    assert len(groups[qkv]) == cfg.num_layers
    assert len(groups[(2 * cfg.intermediate_size, h, torch.float32)]) == cfg.num_layers
    assert groups[(cfg.vocab_size, h, torch.float32)][0] is not None  # the tied embedding


def test_candidate_configs_are_the_pruned_winners():
    from specserve.layers.gemv import candidate_configs

    shapes = ((6144, 4096), (128256, 4096), (576, 576), (4096, 14336), (576, 1536))
    for n, k in shapes:
        for rows in (1, 2, 3, 8, 9, 16, 17, 32, 33, 64):
            cands = candidate_configs(rows, n, k, num_sms=132)
            assert 4 <= len(cands) <= 7 and len(set(cands)) == len(cands)
            assert all(c.supports(rows, n, k) for c in cands)
            assert (not cands[0].use_dot) == (rows <= 2)  # the CUDA-core product first
            bm = 16 if rows <= 16 else 32 if rows <= 32 else 64
            assert all(c.block_m == bm for c in cands if c.use_dot)  # the weight read once
            assert all(-(-k // c.split_k) >= c.block_k for c in cands)
            assert any(c.split_k > 1 for c in cands) == (k > n)  # splits only for a long K
    down = candidate_configs(1, 4096, 14336, num_sms=132)
    assert [str(c) for c in down if c.split_k > 1] == ["dot m16 n64 k128 s4 w4 st4"]


def test_small_buckets_time_one_shared_list_without_the_cuda_core_path():
    from specserve.layers.gemv import candidate_configs
    from specserve.layers.gemv_select import ROW_BUCKETS, bucket_candidates

    for n, k in ((4096, 4096), (4096, 14336), (576, 576)):
        jobs = dict(bucket_candidates(ROW_BUCKETS, n, k, num_sms=132))
        small = [jobs[b] for b in (1, 2, 4, 8, 16)]
        assert all(c == small[0] for c in small) and len(small[0]) >= 4
        assert all(c.use_dot and c.block_m == 16 for c in small[0])  # one variant per tile
        assert jobs[32] == candidate_configs(32, n, k, 132)
        assert jobs[64] == candidate_configs(64, n, k, 132)


def _fake_selection(monkeypatch, us) -> dict:
    """The selector's choices for one shape [96, 64] with `_measure` replaced by
    `us(config, rows)` (microseconds; config None: torch)."""
    from specserve.layers.gemv_select import ROW_BUCKETS, GemvSelector, bucket_candidates

    selector = GemvSelector()
    monkeypatch.setattr(selector, "_measure", lambda cfg, x, rotation: us(cfg, x.shape[0]))
    jobs = bucket_candidates(ROW_BUCKETS, 96, 64, num_sms=132)
    selector._measure_shape(96, 64, torch.float16, jobs, [torch.zeros(96, 64)], 1e18)
    return {b: selector.measured[(b, 96, 64, torch.float16)] for b in ROW_BUCKETS}


def test_selection_shares_one_config_over_small_buckets(monkeypatch):
    from specserve.layers.gemv_select import ROW_BUCKETS, bucket_candidates

    jobs = dict(bucket_candidates(ROW_BUCKETS, 96, 64, num_sms=132))
    a, b = jobs[1][0], jobs[1][1]
    tall = jobs[64][-1]

    def us(cfg, rows):  # a: fastest at one row only; b: fastest summed over 1..16
        if cfg is None:
            return 10.0
        if rows > 16:
            return 5.0 if cfg == tall else 9.0
        return {a: 5.0 if rows == 1 else 9.9, b: 8.0}.get(cfg, 9.5)

    choices = _fake_selection(monkeypatch, us)
    assert choices[1].config == b
    assert all(choices[r].config is choices[1].config for r in (2, 4, 8, 16))  # one object
    assert choices[1].best_us == 8.0 and choices[1].torch_us == 10.0
    assert choices[64].config == tall and choices[32].config == jobs[32][0]  # per bucket
    assert all(c.tried == 1 + len(jobs[r]) for r, c in choices.items())


def test_selection_keeps_torch_unless_a_config_wins_over_the_small_buckets(monkeypatch):
    from specserve.layers.gemv_select import ROW_BUCKETS, GemvPlan, bucket_candidates

    a = bucket_candidates((4,), 96, 64, num_sms=132)[0][1][0]

    def us(cfg, rows):  # a wins by far at 4 rows, loses everywhere else; 64 rows: any config
        if cfg is None:
            return 10.0
        if rows == 64:
            return 7.0
        return 2.0 if (cfg == a and rows == 4) else 12.0

    choices = _fake_selection(monkeypatch, us)
    assert all(choices[r].config is None for r in (1, 2, 4, 8, 16, 32))
    assert choices[4].best_us == choices[4].torch_us == 10.0
    assert choices[64].config is not None  # the larger buckets choose on their own
    plan = GemvPlan({(r, 96, 64, torch.float16): c for r, c in choices.items()}, ROW_BUCKETS)
    assert {plan.config_for(r, 96, 64, torch.float16) for r in range(1, 33)} == {None}


def test_rotation_set_exceeds_the_cache_with_distinct_weights():
    from specserve.layers.gemv_select import rotation_set

    own = [torch.zeros(10, 10), torch.ones(10, 10)]  # 400 bytes each
    rotation = rotation_set(own, min_bytes=1000)
    assert rotation[:2] == own and len({id(w) for w in rotation}) == 3  # one clone
    assert len(rotation) == 4 and rotation[3] is rotation[0]  # repeated up to min_calls
    assert len(rotation_set(own, min_bytes=10**9, max_calls=7)) == 7


# ---- GPU ------------------------------------------------------------------------------------
GPU_SHAPES = {  # (N, K): Llama-3.1-8B, its EAGLE-3 head's fc, SmolLM2-135M
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    "lm_head": (128256, 4096), "eagle_fc": (4096, 12288), "smol_qkv": (960, 576),
    "smol_down": (576, 1536), "smol_lm_head": (49152, 576),
}  # fmt: skip
GPU_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_every_candidate_matches_torch(dtype, shape):
    from specserve.layers.gemv import GemvConfig, candidate_configs

    n, k = GPU_SHAPES[shape]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for rows in (1, 2, 13, 32, 64):  # every compiled variant: fma 1/2, row blocks 16/32/64
        for cfg in candidate_configs(rows, n, k, sms):
            err = gemv_error(cfg, rows, n, k, dtype, "cuda", seed=rows)
            assert err < GPU_TOL[dtype], (shape, rows, str(cfg), err)
    for cfg in (GemvConfig(64, 128, 1), GemvConfig(64, 128, 4)):  # odd rows, bias
        assert gemv_error(cfg, 3, n, k, dtype, "cuda", bias=True) < GPU_TOL[dtype], str(cfg)
    for rows, bm in ((21, 16), (45, 32), (50, 64)):  # several row blocks, or one partial
        cfg = GemvConfig(64, 128, 2, block_m=bm)
        assert gemv_error(cfg, rows, n, k, dtype, "cuda", bias=True) < GPU_TOL[dtype], str(cfg)


@pytest.mark.gpu
def test_gpu_gemv_is_graph_safe_and_reproducible():
    from specserve.layers.gemv import GemvConfig, gemv

    w = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    cases = ((4, GemvConfig(block_n=64, block_k=128, split_k=8)),
             (64, GemvConfig(block_n=64, block_k=128, split_k=4, block_m=64)))  # fmt: skip
    for rows, cfg in cases:
        x = torch.randn(rows, 14336, device="cuda", dtype=torch.bfloat16)
        eager = gemv(x, w, None, cfg)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin()
            out = gemv(x, w, None, cfg)
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_selector_plans_a_model_that_still_matches_torch(dtype):
    from specserve.layers.gemv_select import GemvSelector
    from specserve.layers.linear import use_gemv
    from tests.model_cases import tiny_config, tiny_model

    cfg = tiny_config(hidden_size=256, intermediate_size=512, vocab_size=1000, head_dim=64)
    model = tiny_model(cfg, dtype, "cuda")
    x = torch.randn(4, cfg.hidden_size, device="cuda", dtype=dtype)
    ref = model.compute_logits(x)
    selector = GemvSelector(budget_s=30.0)
    plan = use_gemv(model, selector)
    assert len(plan.choices) == 5 * 7  # (qkv, o, gate_up, down, lm_head) x row buckets
    assert rel_err(model.compute_logits(x), ref) < GPU_TOL[dtype]
    assert selector.skipped == 0 and selector.compiled > 0
    shared: dict[tuple, list] = {}
    for row in plan.summary():
        assert row["tried"] >= 5
        if row["rows"] <= 16:  # one choice for buckets 1..16, faster summed over them
            shared.setdefault((row["n"], row["k"]), []).append(row)
        else:
            assert row["best_us"] <= row["torch_us"]
    for rows in shared.values():
        assert len({r["kernel"] for r in rows}) == 1
        assert sum(r["best_us"] for r in rows) <= sum(r["torch_us"] for r in rows)
    # a second model with the same shapes: nothing new to measure or compile
    other = tiny_model(cfg, dtype, "cuda", seed=1)
    again = use_gemv(other, selector)
    assert selector.compiled == 0 and again.choices == plan.choices


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_model_decode_through_gemv(dtype):
    from specserve.layers.gemv import GemvConfig

    errs = model_decode_errors(dtype, "cuda", GemvConfig(block_n=32, block_k=64, split_k=2))
    assert max(errs["q1"], errs["q3"], errs["q8"]) < 3 * GPU_TOL[dtype], errs
    assert errs["q12"] == 0.0, errs


if __name__ == "__main__":  # the interpreter run (TRITON_INTERPRET=1), see the fixture
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.stdout.write("\n" + json.dumps(run_cases()) + "\n")
