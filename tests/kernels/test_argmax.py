"""The two-kernel row argmax (kernels/triton_argmax.py) equals torch.argmax index for index:
through the Triton interpreter on the CPU (in a subprocess, tests/support/interpreter_run.py) over
fp32/fp16/bf16 rows of several chunks, the last one partial, with ties within and across
chunks, NaN (any sign, anywhere), -inf and signed-zero rows, subnormals and strided rows;
both kernels compiled for sm_90 with PDL (they wait before touching memory, as every
decode-path kernel does); on a GPU (`-m gpu`) at the serving shapes, and replayed from a
CUDA graph."""

from __future__ import annotations

import pytest
import torch

NAN, INF = float("nan"), float("inf")


def case_rows(
    rows: int, n_cols: int, dtype: torch.dtype, kind: str, seed: int, device="cpu"
) -> torch.Tensor:
    """rows x n_cols values of one kind: "random", "ties" (few distinct values: ties in
    every chunk), "planted" (the maximum planted twice per row, in two chunks or one),
    "special" (NaN, inf, -inf, signed zeros, subnormals; one pattern per row)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "ties":
        return torch.randint(0, 4, (rows, n_cols), generator=gen).to(dtype=dtype, device=device)
    x = torch.randn(rows, n_cols, generator=gen)
    if kind == "planted":
        for r in range(rows):
            at = torch.randint(0, n_cols, (2,), generator=gen).tolist()
            if r % 2:  # the second copy right after the first: one chunk, mostly
                at[1] = min(at[0] + 1, n_cols - 1)
            x[r, at] = 7.0
    elif kind == "special":
        n, last = n_cols, n_cols - 1
        patterns = [
            lambda v: v.fill_(-INF),  # all -inf: index 0
            lambda v: v.index_fill_(0, torch.tensor([last, n // 3]), NAN),  # first NaN wins
            lambda v: v.fill_(NAN),
            lambda v: v.index_fill_(0, torch.tensor([0, last]), INF).index_fill_(
                0, torch.tensor([n // 2]), -NAN
            ),  # -NaN above +inf
            lambda v: v.fill_(-0.0).index_fill_(0, torch.tensor([last]), 0.0),  # -0 == +0
            lambda v: v.fill_(-INF).index_fill_(0, torch.tensor([last]), -3.0),
            lambda v: v.mul_(1e-40),  # fp32 subnormals (zeros in fp16/bf16: ties)
            lambda v: v.abs_().neg_(),  # all negative
        ]
        for r in range(rows):
            patterns[r % len(patterns)](x[r])
    return x.to(dtype=dtype, device=device)


# name: (rows, columns, kind, stage-1 block)
CASES = {
    "r1-v1": (1, 1, "random", 16),
    "r1-v1000-b64": (1, 1000, "random", 64),
    "r5-v1000-b64": (5, 1000, "random", 64),
    "r3-v4113-b512": (3, 4113, "random", 512),
    "r1-v256-b256": (1, 256, "random", 256),  # one full chunk
    "r4-v300-ties-b16": (4, 300, "ties", 16),
    "r6-v777-planted-b32": (6, 777, "planted", 32),
    "r8-v200-special-b32": (8, 200, "special", 32),
    "r1-v200-special-b32": (1, 200, "special", 32),
}
DTYPES = ("float32", "float16", "bfloat16")


def mismatches(ours: torch.Tensor, ref: torch.Tensor) -> list:
    """[(row, ours, torch's)] where they differ (also a dtype or shape difference)."""
    if ours.dtype != ref.dtype or ours.shape != ref.shape:
        return [("dtype/shape", str(ours.dtype), tuple(ours.shape), tuple(ref.shape))]
    bad = (ours != ref).nonzero().flatten().tolist()
    return [(r, ours[r].item(), ref[r].item()) for r in bad[:5]]


def run_cases() -> dict:
    from specserve.kernels.triton_argmax import triton_argmax

    results = {}
    for name, (rows, n_cols, kind, block) in CASES.items():
        for dtype in DTYPES:
            x = case_rows(rows, n_cols, getattr(torch, dtype), kind, seed=len(name))
            try:
                results[f"{name}-{dtype}"] = mismatches(triton_argmax(x, block=block), x.argmax(-1))
            except Exception as e:  # reported per case by the test
                results[f"{name}-{dtype}"] = f"{type(e).__name__}: {e}"
    wide = case_rows(4, 96, torch.float32, "planted", seed=1)
    results["strided-rows"] = mismatches(
        triton_argmax(wide[:, 5:90], block=16), wide[:, 5:90].argmax(-1)
    )
    results["no-rows"] = mismatches(triton_argmax(wide[:0], block=16), wide[:0].argmax(-1))
    from specserve.kernels import triton_argmax as ta

    ta.uses_triton = lambda x: True  # the dispatcher's shapes, as on CUDA
    many = case_rows(6, 5000, torch.float16, "planted", seed=2)
    results["dispatch-3d"] = mismatches(
        ta.argmax_rows(many.view(2, 3, -1)).flatten(), many.argmax(-1)
    )
    one = ta.argmax_rows(many[4])
    results["dispatch-1d"] = [] if one.shape == () and one == many[4].argmax() else [str(one)]
    return results


# the interpreter run (module, seconds idle) whose results the `interpreter_results` fixture
# gives this file's tests (conftest.py; started in the background: tests/support/interpreter_run.py)
INTERPRETER = ("tests.kernels.test_argmax", 600)


@pytest.mark.parametrize(
    "name",
    [f"{c}-{d}" for c in CASES for d in DTYPES]
    + ["strided-rows", "no-rows", "dispatch-3d", "dispatch-1d"],
)
def test_interpreter_equals_torch_argmax(name, interpreter_results):
    assert interpreter_results[name] == [], interpreter_results[name]


def test_block_and_dispatch_rules():
    pytest.importorskip("triton")
    from specserve.kernels import triton_argmax as ta

    assert ta.chunk_block(128256, 4) == 2048 and ta.chunk_block(32000, 2) == 4096
    assert ta.chunk_block(128256, 2, block=512) == 512
    assert ta.chunk_block(10**7, 4) * ta.MAX_CHUNKS >= 10**7  # at most MAX_CHUNKS partials
    x = torch.randn(3, 8192)
    assert not ta.uses_triton(x)  # CPU: torch
    assert torch.equal(ta.argmax_rows(x), x.argmax(-1))
    assert torch.equal(ta.argmax_rows(x[0]), x[0].argmax(-1))
    with pytest.raises(ValueError, match="contiguous rows"):
        ta.triton_argmax(x.t())


def test_mode_switch():
    pytest.importorskip("triton")
    from specserve.kernels import triton_argmax as ta

    previous = ta.set_mode("off")  # (this module's tests run under "always")
    assert ta.set_mode("graphs") == "off"
    with pytest.raises(ValueError, match="argmax mode must be one of"):
        ta.set_mode("on")
    assert ta.set_mode(previous) == "graphs"  # a refused mode changes nothing


def test_kernels_wait_before_touching_memory():
    """Compiled for sm_90 (tests/support/pdl_compile.py's machinery, in a subprocess): with PDL on,
    each kernel waits before its first load and store and signals after; off, neither."""
    from tests.support.pdl_compile import compiled_in_subprocess

    pytest.importorskip("triton")
    compiled = compiled_in_subprocess(["tests.kernels.test_argmax", "compile"], 300)
    assert len(compiled) == 4, compiled
    for name, marks in compiled.items():
        assert isinstance(marks, dict), f"{name} did not compile: {marks}"
        if name.endswith("/pdl"):
            assert marks["launch_pdl"] and marks["wait"] is not None, (name, marks)
            assert marks["wait"] < marks["launch"] < marks["load"] < marks["store"], marks
        else:
            assert marks["wait"] is None and marks["launch"] is None, (name, marks)
            assert marks["load"] is not None and marks["store"] is not None, (name, marks)


def compile_cases() -> dict:
    """{kernel/mode: pdl_compile's marks} for one bf16 argmax with PDL forced on, then off."""

    from specserve.kernels import pdl
    from specserve.kernels.triton_argmax import triton_argmax
    from tests.support import pdl_compile as pc

    pc._record()  # launches recorded, not run
    results = {}
    for mode in ("pdl", "plain"):
        pc.LAUNCHES.clear()
        pdl.active = lambda device, on=(mode == "pdl"): on
        triton_argmax(torch.zeros(2, 8192, dtype=torch.bfloat16))
        for _, fn, args, kwargs in pc.LAUNCHES:
            try:
                marks = pc._marks(pc.compile_launch(fn, args, kwargs).asm["ptx"])
                results[f"{fn.__name__}/{mode}"] = {
                    **marks,
                    "launch_pdl": kwargs.get("launch_pdl", False),
                }
            except Exception as e:  # reported per kernel by the test
                results[f"{fn.__name__}/{mode}"] = f"{type(e).__name__}: {e}"[:2000]
    return results


# ---- GPU: the serving shapes ------------------------------------------------------------
SHAPES = [(128256, torch.float32), (128256, torch.bfloat16), (32000, torch.bfloat16)]


@pytest.fixture(autouse=True)
def kernels_on():
    """The dispatcher's kernels on for eager calls too (by default only in graph capture)."""
    from specserve.kernels import triton_argmax

    previous = triton_argmax.set_mode("always")
    yield
    triton_argmax.set_mode(previous)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 64])
@pytest.mark.parametrize("n_cols,dtype", SHAPES)
@pytest.mark.parametrize("kind", ["random", "planted", "ties", "special"])
def test_gpu_equals_torch_argmax(rows, n_cols, dtype, kind):
    from specserve.kernels.triton_argmax import argmax_rows, uses_triton

    x = case_rows(rows, n_cols, dtype, kind, seed=rows + n_cols, device="cuda")
    assert uses_triton(x)
    assert mismatches(argmax_rows(x), x.argmax(-1)) == []
    assert argmax_rows(x[-1]).shape == () and argmax_rows(x[-1]) == x[-1].argmax()
    if rows > 1:  # a batch of one row each, as [rows, 1, V]
        assert mismatches(argmax_rows(x[:, None]).flatten(), x.argmax(-1)) == []


@pytest.mark.gpu
def test_gpu_graphs_mode_takes_the_kernels_only_in_capture():
    from specserve.kernels import triton_argmax as ta

    previous = ta.set_mode("graphs")
    try:
        x = case_rows(2, 128256, torch.bfloat16, "planted", seed=5, device="cuda")
        assert not ta.uses_triton(x)  # eager: torch's single launch
        graph = torch.cuda.CUDAGraph()
        seen = []
        with torch.cuda.graph(graph):
            seen.append(ta.uses_triton(x))
        assert seen == [True]
    finally:
        ta.set_mode(previous)


@pytest.mark.gpu
@pytest.mark.parametrize("use_pdl", [True, False])
def test_gpu_cuda_graph_replay(use_pdl):
    from specserve.kernels import pdl
    from specserve.kernels.triton_argmax import argmax_rows

    previous = pdl.set_enabled(use_pdl)
    try:
        x = case_rows(4, 128256, torch.bfloat16, "planted", seed=3, device="cuda")
        argmax_rows(x)  # compiled before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            first = argmax_rows(x)
            second = argmax_rows(x[1:])  # chained: the PDL wait orders them
        for seed, kind in enumerate(["planted", "special", "ties", "random"]):
            x.copy_(case_rows(4, 128256, torch.bfloat16, kind, seed=seed, device="cuda"))
            graph.replay()
            assert mismatches(first, x.argmax(-1)) == [], kind
            assert mismatches(second, x[1:].argmax(-1)) == [], kind
    finally:
        pdl.set_enabled(previous)


if __name__ == "__main__":  # the interpreter run (TRITON_INTERPRET=1) or the sm_90 compile
    from tests.support.interpreter_run import module_main

    module_main(run_cases, compile_cases)
