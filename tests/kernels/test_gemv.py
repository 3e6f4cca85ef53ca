"""The Triton GEMV (kernels/gemv.py), its start-up selection (gemv_select.py) and the linear
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
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.support.triton_cases import rel_err

TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def gemv_error(config, rows: int, n: int, k: int, dtype, device, bias=False, seed=0):
    """Relative error of gemv against a float64 reference; inf when two calls differ."""
    from specserve.kernels.gemv import gemv

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
    from specserve.kernels.gemv import GemvConfig

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
            split,
            rows_list[-1],
            40,
            256,
            "float16",
            True,
        )
    # weight tiles through a tensor descriptor: N and K off the tile (zero-filled edges)
    for bm, rows in ((16, 5), (64, 33), (64, 64)):
        tma = GemvConfig(block_n=16, block_k=64, block_m=bm, tma=True)
        cases[f"tma-m{bm}-float16-m{rows}"] = (tma, rows, 72, 200, "float16", False)
        split = GemvConfig(block_n=32, block_k=32, split_k=3, block_m=bm, tma=True)
        cases[f"tma-m{bm}-split3-bias-float32-m{rows}"] = (split, rows, 40, 256, "float32", True)
    tail = GemvConfig(block_n=16, block_k=32, split_k=3, tma=True)  # the last slice's K tail
    cases["tma-split3-ktail-float16-m5"] = (tail, 5, 72, 200, "float16", False)
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
    from specserve.core.kv_cache import KVCache
    from specserve.layers.attention import TorchAttentionBackend
    from specserve.tuning.gemv_select import GemvPlan, use_gemv
    from tests.support.model_cases import build_meta, tiny_config, tiny_model

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


def row_invariance_failures(
    dtype, n: int = 72, k: int = 600, device: str = "cpu", shared=None, mode: str = "plain"
) -> list[str]:
    """The configurations the selector may share across row buckets 1..16 (a long K: a K
    split among them; K off the block sizes) whose rows for M = 1, 4, 16, 20 or 64 differ,
    bit for bit, from the same rows computed 16 at a time (M = 20 and 64: a verify step's
    rows, 2 and 4 row blocks per program, `gemv_configs.row_blocks`). `shared`: those
    configurations (default: the selector's candidates); `mode` "silu" (x holds [gate | up])
    or "gated" (the weight [gate; up] of 2n rows, through each one's `gated_config`)."""
    from specserve.kernels.gemv import gemv
    from specserve.kernels.gemv_configs import gated_config
    from specserve.tuning.gemv_select import bucket_candidates

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, k * (2 if mode == "silu" else 1), generator=gen)
    w = torch.randn(n * (2 if mode == "gated" else 1), k, generator=gen) / k**0.5
    x, w = (t.to(dtype=dtype, device=device) for t in (x, w))
    if shared is None:
        (_, shared), *_ = bucket_candidates((1,), n, k, num_sms=132)
        assert any(c.split_k > 1 for c in shared)
    if mode == "gated":
        shared = list(filter(None, map(gated_config, shared)))
    kw = dict(silu=mode == "silu", gated=mode == "gated")
    failures = []
    for cfg in shared:
        alone = torch.cat([gemv(x[i : i + 16], w, None, cfg, **kw) for i in range(0, 64, 16)])
        for m in (1, 4, 16, 20, 64):
            if not torch.equal(gemv(x[:m], w, None, cfg, **kw), alone[:m]):
                failures.append(f"{cfg} M={m}")
    return failures


def run_cases() -> dict:
    from specserve.kernels.gemv import GemvConfig

    results: dict = {}
    for name, (cfg, rows, n, k, dtype, bias) in _interpreter_cases().items():
        try:
            results[name] = gemv_error(
                cfg, rows, n, k, getattr(torch, dtype), "cpu", bias, seed=len(name)
            )
        except Exception as e:  # reported per case by the test
            results[name] = f"{type(e).__name__}: {e}"
    for dtype in ("float32", "float16"):
        try:
            results[f"rows-invariant-{dtype}"] = row_invariance_failures(getattr(torch, dtype))
            results[f"rows-invariant-{dtype}"] += row_invariance_failures(
                getattr(torch, dtype), 40, mode="gated"
            )
        except Exception as e:
            results[f"rows-invariant-{dtype}"] = f"{type(e).__name__}: {e}"
        cfg = GemvConfig(block_n=16, block_k=32, split_k=2)
        try:
            results[f"model-{dtype}"] = model_decode_errors(getattr(torch, dtype), "cpu", cfg)
        except Exception as e:
            results[f"model-{dtype}"] = f"{type(e).__name__}: {e}"
    return results


# the interpreter run (module, seconds idle) whose results the `interpreter_results` fixture
# gives this file's tests (conftest.py; started in the background: tests/support/interpreter_run.py)
INTERPRETER = ("tests.kernels.test_gemv", 600)


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
def test_tma_configs_need_the_matrix_unit_path_and_16_byte_weight_rows():
    from specserve.kernels.gemv_configs import GemvConfig

    tma = GemvConfig(64, 128, tma=True)
    assert tma.supports(64, 4096, 4096) and not tma.supports(64, 4096, 4100)  # 8200 bytes
    assert not GemvConfig(8, 512, use_dot=False, tma=True).supports(1, 4096, 4096)


GPU_SHAPES = {  # (N, K): Llama-3.1-8B, its EAGLE-3 head's fc, SmolLM2-135M
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
    "eagle_fc": (4096, 12288),
    "smol_qkv": (960, 576),
    "smol_down": (576, 1536),
    "smol_lm_head": (49152, 576),
}
GPU_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, dtype",
    [(s, torch.bfloat16) for s in sorted(GPU_SHAPES)]
    + [("down", torch.float16), ("smol_qkv", torch.float16)],
)
def test_gpu_every_candidate_matches_torch(dtype, shape):
    """Every start-up candidate of every shape in bf16 (the kernels are generic in the
    dtype: fp16 at two shapes; each case compiles all its candidates, about 30 s)."""
    from specserve.kernels.gemv import GemvConfig, candidate_configs, gemv, row_block

    n, k = GPU_SHAPES[shape]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    runs = [
        (rows, cfg)
        for rows in (1, 2, 13, 32, 64)  # every variant: fma 1/2, blocks 16-64
        for cfg in candidate_configs(rows, n, k, sms)
    ]
    w = torch.zeros(n, k, device="cuda", dtype=dtype)
    gemv(torch.zeros(1, k, device="cuda", dtype=dtype), w, None, runs[0][1], compile_only=True)
    with ThreadPoolExecutor(8) as pool:  # compile them in parallel first, as the selector does
        list(
            pool.map(
                lambda run: gemv(
                    torch.zeros(run[0], k, device="cuda", dtype=dtype),
                    w,
                    None,
                    run[1],
                    compile_only=True,
                ),
                runs,
            )
        )
    for rows, cfg in runs:
        err = gemv_error(cfg, rows, n, k, dtype, "cuda", seed=rows)
        assert err < GPU_TOL[dtype], (shape, rows, str(cfg), err)
    for cfg in (GemvConfig(64, 128, 1), GemvConfig(64, 128, 4)):  # odd rows, bias
        assert gemv_error(cfg, 3, n, k, dtype, "cuda", bias=True) < GPU_TOL[dtype], str(cfg)
    for rows, bm in ((21, 16), (45, 32), (50, 64)):  # several row blocks, or one partial
        cfg = GemvConfig(64, 128, 2, block_m=bm)
        assert gemv_error(cfg, rows, n, k, dtype, "cuda", bias=True) < GPU_TOL[dtype], str(cfg)
    for rows, split in ((1, 1), (33, 2), (64, 1)):  # weight tiles through a tensor descriptor
        cfg = GemvConfig(64, 128, split, num_stages=4, block_m=row_block(rows), tma=True)
        assert gemv_error(cfg, rows, n, k, dtype, "cuda", bias=True) < GPU_TOL[dtype], str(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_shared_tiles_give_verify_rows_the_bits_of_decode_rows(dtype):
    """The 16-row tiles shared by row buckets 1..16 at Llama-3.1-8B's shapes (qkv, o, down,
    lm_head; the down projection with its SiLU-and-mul prologue; the merged gate/up with
    its gated epilogue): rows at M = 1..64, 2 or 4 row blocks per program above 16 rows,
    bit for bit those of the same rows run 16 at a time (what a verify step of up to 16
    requests needs: the rows of its requests' decode steps)."""
    failures = []
    for n, k, mode in (
        (6144, 4096, "plain"),
        (4096, 4096, "plain"),
        (4096, 14336, "plain"),
        (128256, 4096, "plain"),
        (4096, 14336, "silu"),
        (14336, 4096, "gated"),
    ):
        from specserve.tuning.gemv_select import bucket_candidates

        (_, shared), *_ = bucket_candidates((1,), n, k, num_sms=132)
        failures += [
            f"{n}x{k} {mode}: {f}"
            for f in row_invariance_failures(dtype, n, k, "cuda", shared, mode)
        ]
    assert failures == []


@pytest.mark.gpu
def test_gpu_gemv_is_graph_safe_and_reproducible():
    from specserve.kernels.gemv import GemvConfig, gemv

    w = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    cases = (
        (4, GemvConfig(block_n=64, block_k=128, split_k=8)),
        (64, GemvConfig(block_n=64, block_k=128, split_k=4, block_m=64)),
    )
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
    from specserve.tuning import gemv_select
    from specserve.tuning.gemv_select import GemvSelector, use_gemv
    from tests.support.model_cases import tiny_config, tiny_model

    gemv_select._MEASURED.clear()  # engines of earlier tests may have measured these shapes
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
        if rows[0].get("torch_varies"):  # cuBLAS rounds rows by row count: never torch here
            assert rows[0]["kernel"] != "torch"
        else:
            assert sum(r["best_us"] for r in rows) <= sum(r["torch_us"] for r in rows)
    # a second model with the same shapes, through this selector or a new one of the same
    # buckets (the next engine of this process): nothing new to measure or compile
    other = tiny_model(cfg, dtype, "cuda", seed=1)
    again = use_gemv(other, selector)
    assert selector.compiled == 0 and again.choices == plan.choices
    fresh = GemvSelector(budget_s=30.0)
    assert use_gemv(tiny_model(cfg, dtype, "cuda", seed=2), fresh).choices == plan.choices
    assert fresh.compiled == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_model_decode_through_gemv(dtype):
    from specserve.kernels.gemv import GemvConfig

    errs = model_decode_errors(dtype, "cuda", GemvConfig(block_n=32, block_k=64, split_k=2))
    assert max(errs["q1"], errs["q3"], errs["q8"]) < 3 * GPU_TOL[dtype], errs
    assert errs["q12"] == 0.0, errs


if __name__ == "__main__":  # the interpreter run (TRITON_INTERPRET=1), see the fixture
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.stdout.write("\n" + json.dumps(run_cases()) + "\n")
