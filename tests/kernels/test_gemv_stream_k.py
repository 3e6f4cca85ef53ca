"""The stream-K GEMV (kernels/gemv_stream_k.py): through the Triton interpreter on the CPU in
one subprocess (4 programs, so tiles split between programs and the last to finish sums
them): right against a float64 reference with and without bias and the SiLU prologue, the
same bits on a second call, every tile counter back at zero, the gated epilogue right (the
rope epilogue never runs on stream-K tiles: `rope_fits`). Candidates and the engine switch
are tested directly; on a GPU (`-m gpu`) the 8B shapes at 33 and 64 rows, and the same bits
over many CUDA-graph replays (a race between the programs that share a tile would show
there)."""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest
import torch

from tests.support.interpreter_run import record_case
from tests.support.triton_cases import rel_err

TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def split_tiles(rows: int, n: int, k: int, cfg, programs: int) -> int:
    """How many tiles the schedule splits between programs (the fix-up path's work)."""
    iters = -(-k // cfg.block_k)
    tiles = -(-rows // cfg.block_m) * -(-n // cfg.block_n)
    units = tiles * iters
    programs = min(programs, units)
    owner = [((u + 1) * programs - 1) // units for u in range(units)]
    return sum(owner[t * iters] != owner[t * iters + iters - 1] for t in range(tiles))


def stream_k_case(
    cfg, rows: int, n: int, k: int, dtype, device, bias=False, silu=False, seed=0
) -> dict:
    """{"err": against float64, "same": a second call's bits, "counters": the tile counters'
    sum after the calls (0: put back), "split": tiles split between programs}."""
    from specserve.kernels import gemv_stream_k
    from specserve.kernels.gemv import gemv

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * k if silu else k, generator=gen).to(dtype=dtype, device=device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype=dtype, device=device)
    b = torch.randn(n, generator=gen).to(dtype=dtype, device=device) if bias else None
    out = gemv(x, w, b, cfg, silu=silu)
    again = gemv(x, w, b, cfg, silu=silu)
    if silu:
        gate = torch.nn.functional.silu(x[:, :k].float()).to(dtype)
        x = (gate.double() * x[:, k:].double()).to(dtype)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    counters = gemv_stream_k._COUNTERS[out.device]  # (cuda:0, not cuda)
    return {
        "err": rel_err(out, ref),
        "same": torch.equal(out, again),
        "counters": int(counters.abs().sum()),
        "dtype": str(out.dtype),
        "split": split_tiles(rows, n, k, cfg, gemv_stream_k.num_programs(out.device)),
    }


def _cases() -> dict[str, tuple]:
    """name -> (config, rows, n, k, dtype, bias, silu); K and N off the blocks, shapes whose
    units do not fall to the 4 programs in whole tiles."""
    from specserve.kernels.gemv import GemvConfig

    m16 = GemvConfig(16, 32, stream_k=True)
    m32 = GemvConfig(32, 64, block_m=32, stream_k=True)
    m64 = GemvConfig(16, 64, block_m=64, stream_k=True)
    cases = {}
    for dtype in ("float32", "float16"):
        cases[f"m16-{dtype}-r1"] = (m16, 1, 72, 200, dtype, False, False)
        cases[f"m16-{dtype}-r17-bias"] = (m16, 17, 40, 256, dtype, True, False)
        cases[f"m32-{dtype}-r33-silu"] = (m32, 33, 72, 320, dtype, False, True)
        cases[f"m64-{dtype}-r64-bias"] = (m64, 64, 96, 96, dtype, True, False)
        cases[f"m32-{dtype}-r5-wide"] = (m32, 5, 968, 160, dtype, False, False)
    # one tile among 4 programs (4 pieces, the middle ones in slot 0), and 3 units, 3 programs
    cases["m32-float32-r5-four-pieces"] = (m32, 5, 32, 512, "float32", True, False)
    cases["m32-float32-r5-three-programs"] = (m32, 5, 32, 192, "float32", False, False)
    return cases


def run_cases() -> dict:
    from specserve.kernels.gemv import GemvConfig
    from tests.support.fusion_cases import gated_gemv_case

    results: dict = {}
    record = functools.partial(record_case, results)

    for name, (cfg, rows, n, k, dtype, bias, silu) in _cases().items():
        record(
            name,
            stream_k_case,
            cfg,
            rows,
            n,
            k,
            getattr(torch, dtype),
            "cpu",
            bias,
            silu,
            seed=len(name),
        )
    for dtype in ("float32", "float16"):  # SiLU-and-mul as the gate/up epilogue
        record(
            f"gated-{dtype}-r33",
            gated_gemv_case,
            GemvConfig(32, 64, block_m=64, stream_k=True),
            33,
            72,
            200,
            getattr(torch, dtype),
            "cpu",
            bias=True,
            seed=33,
        )
    return results


# the interpreter run (module, seconds idle) whose results the `interpreter_results` fixture
# gives this file's tests (conftest.py; started in the background: tests/support/interpreter_run.py)
INTERPRETER = ("tests.kernels.test_gemv_stream_k", 600)


def _names() -> list[str]:
    try:
        return sorted(_cases())
    except ImportError:  # no triton: the fixture skips
        return ["triton-missing"]


@pytest.mark.parametrize("name", _names())
def test_interpreter_stream_k_is_right_reproducible_and_resets_its_counters(
    name, interpreter_results
):
    res = interpreter_results[name]
    assert isinstance(res, dict), f"{name} raised {res}"
    dtype = getattr(torch, next(d for d in ("float16", "float32") if d in name))
    assert res["err"] <= TOL[dtype] and res["same"] and res["counters"] == 0, res
    assert res["dtype"] == str(dtype) and res["split"] > 0, res  # the fix-up path ran


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_interpreter_stream_k_gated_epilogue(dtype, interpreter_results):
    """SiLU-and-mul in the stream-K gate/up GEMV's epilogue, both halves' pieces summed by
    the last program: right against a float64 reference (not bitwise the plain stream-K's:
    its tiles split elsewhere)."""
    from specserve.kernels.gemv import GemvConfig

    res = interpreter_results[f"gated-{dtype}-r33"]
    assert isinstance(res, dict), res
    assert res["err"] <= TOL[getattr(torch, dtype)], res
    assert split_tiles(33, 72, 200, GemvConfig(32, 64, block_m=64), 4) > 0


def test_stream_k_schedule_gives_every_split_tile_its_pieces_in_k_order():
    """The kernel's schedule arithmetic, in Python: every program gets units; a tile's
    contributors are exactly lo..hi (the owner formula), their K ranges join up in order;
    a program holds at most one piece per slot, and the slot a finisher reads for each
    contributor is the slot that contributor wrote."""
    for tiles in range(1, 40):
        for iters in range(1, 20):
            units = tiles * iters
            for programs in (1, 2, 3, 4, 5, 7, 132):
                programs = min(programs, units)
                starts = [p * units // programs for p in range(programs + 1)]
                assert all(a < b for a, b in zip(starts, starts[1:]))
                written = {}
                for p in range(programs):
                    first = starts[p] // iters
                    for t in range(first, -(-starts[p + 1] // iters)):
                        lo_k = max(starts[p] - t * iters, 0)
                        hi_k = min(starts[p + 1] - t * iters, iters)
                        if (lo_k, hi_k) != (0, iters):
                            slot = 0 if t == first else 1
                            assert (p, slot) not in written
                            written[(p, slot)] = (t, lo_k, hi_k)
                for t in range(tiles):
                    lo = ((t * iters + 1) * programs - 1) // units
                    hi = ((t * iters + iters) * programs - 1) // units
                    if lo == hi:
                        continue
                    ranges = [
                        written[(q, 0 if t == starts[q] // iters else 1)] for q in range(lo, hi + 1)
                    ]
                    assert [r[0] for r in ranges] == [t] * (hi - lo + 1)
                    assert ranges[0][1] == 0 and ranges[-1][2] == iters
                    assert all(a[2] == b[1] for a, b in zip(ranges, ranges[1:]))


def test_stream_k_candidates_only_when_switched_on_and_only_above_16_rows():
    from specserve.kernels import gemv_configs
    from specserve.kernels.gemv_configs import GemvConfig, candidate_configs, gated_config

    def has_stream_k(rows):
        return any(c.stream_k for c in candidate_configs(rows, 6144, 4096, 132))

    try:
        gemv_configs.set_stream_k(False)
        assert not has_stream_k(64)
        gemv_configs.set_stream_k(True)
        assert has_stream_k(64) and has_stream_k(32) and not has_stream_k(16)
        assert str(next(c for c in candidate_configs(64, 6144, 4096, 132) if c.stream_k)).endswith(
            " sk"
        )
    finally:
        gemv_configs.set_stream_k(False)
    assert not GemvConfig(64, 128, split_k=2, stream_k=True).supports(64, 4096, 4096)
    assert not GemvConfig(64, 128, tma=True, stream_k=True).supports(64, 4096, 4096)
    assert GemvConfig(64, 128, block_m=64, stream_k=True).supports(64, 4096, 4096)
    half = gated_config(GemvConfig(64, 128, block_m=64, stream_k=True))
    assert half == GemvConfig(32, 128, block_m=64, stream_k=True)  # the gated half tile
    assert split_tiles(64, 6144, 4096, GemvConfig(64, 128, block_m=64), 132) > 0
    # under PDL its L2 prefetch depends on the tile alone: one variant whatever the shape
    from specserve.kernels.gemv import call_prefetch
    from specserve.kernels.gemv_stream_k import prefetch_lines

    sk = GemvConfig(64, 128, block_m=64, stream_k=True)
    assert call_prefetch(sk, 6144, 4096, 2) == call_prefetch(sk, 28672, 4096, 2, True) == 4
    assert prefetch_lines(GemvConfig(128, 64, block_m=64, stream_k=True)) == 2


# ---- GPU ------------------------------------------------------------------------------------
_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_stream_k_at_8b_shapes(dtype):
    """Every stream-K candidate at Llama-3.1-8B's projections (the down projection with the
    SiLU prologue) at 33 and 64 rows: right, reproducible, counters put back; gate/up's
    gated half tile right."""
    from specserve.kernels import gemv_configs
    from specserve.kernels.gemv_configs import candidate_configs, gated_config
    from tests.support.fusion_cases import gated_gemv_case

    gemv_configs.set_stream_k(True)
    try:
        for name, (n, k) in _SHAPES.items():
            for rows in (33, 64):
                for cfg in (c for c in candidate_configs(rows, n, k, 132) if c.stream_k):
                    res = stream_k_case(
                        cfg, rows, n, k, dtype, "cuda", silu=name == "down", seed=rows
                    )
                    assert res["err"] < TOL[dtype] and res["same"], (name, rows, str(cfg), res)
                    assert res["counters"] == 0 and res["split"] > 0, (name, str(cfg), res)
                    if name == "gate_up" and gated_config(cfg) is not None:
                        gated = gated_gemv_case(
                            gated_config(cfg), rows, n // 2, k, dtype, "cuda", seed=rows
                        )
                        assert gated["err"] < TOL[dtype], (rows, str(cfg), gated)
    finally:
        gemv_configs.set_stream_k(False)


@pytest.mark.gpu
def test_gpu_stream_k_same_bits_over_graph_replays():
    """200 replays of a captured stream-K GEMV (the 8B gate/up at 64 rows, PDL as the engine
    runs it) give the first replay's bits every time, and leave the counters at zero: the
    pieces of a split tile are always all written before the last program sums them."""
    from specserve.kernels import gemv_stream_k
    from specserve.kernels.gemv import GemvConfig, gemv

    cfg = GemvConfig(128, 64, block_m=64, num_stages=4, stream_k=True)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16) / 64
    out = torch.empty(64, 28672, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(gemv(x, w, None, cfg))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(gemv(x, w, None, cfg))
    graph.replay()
    first = out.clone()
    differ = 0
    for _ in range(200):
        graph.replay()
        differ += not torch.equal(out, first)
    torch.cuda.synchronize()
    assert differ == 0
    assert rel_err(first, x.double() @ w.double().T) < TOL[torch.bfloat16]
    assert int(gemv_stream_k._COUNTERS[x.device].abs().sum()) == 0


if __name__ == "__main__":  # the interpreter run (TRITON_INTERPRET=1), see the fixture
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.stdout.write("\n" + json.dumps(run_cases()) + "\n")
