"""Probe: do warp-specialized tensor-descriptor tiles stream the 64-row projections faster?

At batch 64 the 8B step's projections stream at 3.0-3.8 TB/s against 4.43 on long streams
(gpu_engine.md, run 37): each kernel's single wave ramps up and drains. A kernel whose
producer warps keep the copy engine fed while consumer warps multiply (Triton's
`tl.range(..., warp_specialize=True)`, in Triton since 3.5 on Hopper for loops of
tensor-descriptor loads) is the design the earlier probes pointed to. This probe times it
against the engine's selected tiles at the Llama-3.1-8B shapes, 64 rows, bf16, each call
over its own weights (a rotation that overflows L2), each call after the small RMSNorm
kernel that feeds it in the model (`gemv_timing.after_producer`), in CUDA graphs, PDL on
where the device has it; us per call, median of the rounds:

  engine       gemv() with the tile start-up selection chose at 64 rows (run 37's plan)
  engine TILE  gemv() with another tile (--engine-tiles), by pointer loads or "tma" (the
               engine's tensor-descriptor weight loads; x by pointers)
  torch        F.linear (cuBLAS); gate_up: F.linear then SiLU-and-mul
  tma nBN kBK wW stS        a plain tile loop over tensor-descriptor loads of x and the weight
  ws  nBN kBK wW stS        the same loop with warp_specialize=True

gate_up is the gated projection (SiLU-and-mul epilogue, as the engine runs it at 64 rows).
Outputs are compared against the engine's (bf16 rounding apart). Configurations that fail
to compile are listed with their error. Needs CUDA.

    PYTHONPATH=src python scripts/ws_gemv_probe.py --out $OUT/ws
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specserve.layers import pdl
from specserve.layers.gemv import GemvConfig, gemv, silu_mul
from specserve.layers.gemv_timing import after_producer, rotation_set, time_in_graph_us
from specserve.layers.pdl_kernel import pdl_enter

ROWS = 64
SHAPES = {  # name -> (N, K, gated, the engine's tile at 64 rows: run 37's plan)
    "qkv": (6144, 4096, False, GemvConfig(64, 128, 1, 8, 5, True, 64)),
    "o": (4096, 4096, False, GemvConfig(32, 256, 1, 4, 4, True, 64)),
    # gated: gated_config of the plan's n128 tile for the [28672, 4096] weight, each program
    # streaming 64 rows of both halves
    "gate_up": (14336, 4096, True, GemvConfig(64, 64, 1, 4, 4, True, 64)),
    "down": (4096, 14336, False, GemvConfig(64, 128, 2, 4, 5, True, 64)),
}
SMEM_BYTES = 220 * 1024


@triton.jit
def _tile_kernel(
    x_desc,
    w_desc,
    out_ptr,
    N,
    K,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    WS: tl.constexpr,
    GATED: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    if USE_PDL:
        pdl_enter()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES, warp_specialize=WS):
        k0 = i * BLOCK_K
        x = x_desc.load([0, k0])
        w = w_desc.load([n0, k0])
        acc = tl.dot(x, w.T, acc)
        if GATED:
            u = w_desc.load([N + n0, k0])
            acc_u = tl.dot(x, u.T, acc_u)
    m = tl.arange(0, BLOCK_M)
    n = n0 + tl.arange(0, BLOCK_N)
    y = acc.to(out_ptr.dtype.element_ty)
    if GATED:
        y = silu_mul(y, acc_u.to(out_ptr.dtype.element_ty), out_ptr.dtype.element_ty)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], y, mask=(n < N)[None, :])


def tile_fn(bn: int, bk: int, warps: int, stages: int, ws: bool, gated: bool, use_pdl=True):
    """fn(x, w) running `_tile_kernel` with this tile (descriptors built per call: the graph
    keeps each launch's own); PDL as the engine launches, unless use_pdl is False."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    launch = pdl.launch_options(torch.device("cuda")) if use_pdl else {}

    def run(x, w, compile_only=False):
        n = w.shape[0] // (2 if gated else 1)
        out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
        xd = TensorDescriptor.from_tensor(x, [ROWS, bk])
        wd = TensorDescriptor.from_tensor(w, [bn, bk])
        args = (xd, wd, out, n, w.shape[1], out.stride(0))
        consts = dict(BLOCK_M=ROWS, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, WS=ws, GATED=gated,
                      num_warps=warps, **launch)  # fmt: skip
        grid = (triton.cdiv(n, bn),)
        if compile_only:
            _tile_kernel.warmup(*args, grid=grid, **consts)
            return None
        _tile_kernel[grid](*args, **consts)
        return out

    return run


def engine_fn(cfg: GemvConfig, gated: bool):
    return lambda x, w: gemv(x, w, None, cfg, gated=gated)


def torch_fn(gated: bool):
    def run(x, w):
        y = F.linear(x, w)
        if gated:
            g, u = y.chunk(2, dim=-1)
            return F.silu(g) * u
        return y

    return run


def candidates(gated: bool, grid: dict) -> list[tuple]:
    out = []
    for bn, bk, warps, stages, ws in itertools.product(
        grid["block_n"], grid["block_k"], grid["warps"], grid["stages"], grid["ws"]
    ):
        if stages * (ROWS + bn * (2 if gated else 1)) * bk * 2 > SMEM_BYTES:
            continue
        out.append((bn, bk, warps, stages, bool(ws)))
    return out


def label(c: tuple) -> str:
    bn, bk, warps, stages, ws = c
    return f"{'ws ' if ws else 'tma'} n{bn} k{bk} w{warps} st{stages}"


def probe_shape(name: str, grid: dict, args, min_bytes: int) -> dict:
    """Compile, check and time every candidate of one shape."""
    n, k, gated, cfg = SHAPES[name]
    dt = torch.bfloat16
    w = torch.empty((2 * n if gated else n, k), device="cuda", dtype=dt).normal_(0, 0.02)
    x = torch.randn(ROWS, k, device="cuda", dtype=dt)
    cands = candidates(gated, grid)
    failed, no_pdl = {}, set()

    def build(c):  # in a child first (a compiler abort must not end the probe), under PDL,
        # else without it (labelled "nopdl"); the child leaves the binary in Triton's cache
        for use_pdl, key in ((True, label(c)), (False, label(c) + " nopdl")):
            cmd = [sys.executable, __file__, "--compile-one", name, *map(str, map(int, c)),
                   str(use_pdl)]  # fmt: skip
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except subprocess.TimeoutExpired:
                failed[key] = "compile timed out (300 s)"
                continue
            if done.returncode == 0:
                tile_fn(*c, gated, use_pdl=use_pdl)(x, w, compile_only=True)
                if not use_pdl:
                    no_pdl.add(c)
                return
            last = done.stderr.strip().splitlines()[-1:] or [""]  # the exception, no paths
            failed[key] = f"rc {done.returncode}: {last[0][-200:]}"

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(build, cands))
    compile_s = time.perf_counter() - t0
    fns = {"engine": engine_fn(cfg, gated), "torch": torch_fn(gated)}
    for t in args.engine_tiles:
        bn, bk, split, warps, stages = map(int, t.split(","))
        for tma in (False, True):
            c = GemvConfig(bn, bk, split, warps, stages, True, ROWS, tma=tma)
            try:
                gemv(x, w, None, c, compile_only=True, gated=gated)
                fns[f"engine {c}"] = engine_fn(c, gated)
            except Exception as e:  # noqa: BLE001
                failed[f"engine {c}"] = f"{type(e).__name__}: {str(e).splitlines()[-1][-200:]}"
    fns.update({label(c): tile_fn(*c, gated) for c in cands if label(c) not in failed})
    fns.update({label(c) + " nopdl": tile_fn(*c, gated, use_pdl=False) for c in no_pdl})
    ref = fns["engine"](x, w).float()
    errors = {}
    for key, fn in list(fns.items()):
        try:
            y = fn(x, w)
            torch.cuda.synchronize()
            errors[key] = round((y.float() - ref).abs().max().item(), 5)
        except Exception as e:  # noqa: BLE001
            failed[key] = f"{type(e).__name__}: {str(e)[-300:]}"
            del fns[key]
    rotation = rotation_set([w], min_bytes)
    times = {key: [] for key in fns}
    for _ in range(args.rounds):  # rounds interleave the candidates
        for key, fn in fns.items():
            times[key].append(time_in_graph_us(after_producer(fn, x), x, rotation, args.reps))
    med = {key: round(statistics.median(v), 2) for key, v in times.items()}
    ranked = sorted(med.items(), key=lambda kv: kv[1])
    kb = w.numel() * 2 / 1e3
    print(name, "engine", med["engine"], "torch", med["torch"], "best", ranked[:4],
          f"failed {len(failed)}", flush=True)  # fmt: skip
    return dict(
        n=n, k=k, gated=gated, engine_tile=str(cfg), weight_mb=round(kb / 1e3, 1),
        compile_s=round(compile_s, 1), us=dict(ranked), max_abs_err=errors,
        tbps={key: round(kb / us / 1e3, 2) for key, us in ranked[:8]}, failed=failed,
    )  # fmt: skip


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--block-n", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--block-k", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4, 5])
    ap.add_argument("--ws", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument(
        "--engine-tiles",
        nargs="*",
        default=[],
        metavar="N,K,SPLIT,WARPS,STAGES",
        help="more tiles of the engine's gemv to time, each by pointers and tma",
    )
    ap.add_argument("--compile-one", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compile_one:  # a child of probe_shape's build
        name, *tile, use_pdl = args.compile_one
        n, k, gated, _ = SHAPES[name]
        w = torch.empty((2 * n if gated else n, k), device="cuda", dtype=torch.bfloat16)
        x = torch.empty(ROWS, k, device="cuda", dtype=torch.bfloat16)
        bn, bk, warps, stages, ws = map(int, tile)
        tile_fn(bn, bk, warps, stages, bool(ws), gated, use_pdl == "True")(x, w, True)
        return
    grid = {"block_n": args.block_n, "block_k": args.block_k, "warps": args.warps,
            "stages": args.stages, "ws": args.ws}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    min_bytes = 4 * getattr(props, "L2_cache_size", 64 << 20)
    report = dict(device=props.name, triton=triton.__version__, pdl=pdl.active(torch.device(
        "cuda")), rows=ROWS, shapes={})  # fmt: skip
    for name in args.shapes:
        report["shapes"][name] = probe_shape(name, grid, args, min_bytes)
        (args.out / "ws_gemv_probe.json").write_text(json.dumps(report, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
