"""Probe: does one persistent launch for a layer's MLP at 64 rows beat two launches?

At batch 64 about 4-5 us of every launch in a decode step is neither weight nor K/V
streaming (gpu_engine.md, run 37): each launch ramps up and drains, and under PDL the next
one's programs cannot take a multiprocessor until the last one's leave it. A persistent
layer kernel would keep its programs resident across the dependencies and stream the next
weights while the last tiles of a phase finish. Before building one into the engine this
measures the idea on the simplest dependency of a layer, the MLP's gate/up (SiLU-and-mul
epilogue) followed by the down projection (K split in two, fp32 partial sums), at the
Llama-3.1-8B shape, each call over its own weights (a rotation that overflows L2), in CUDA
graphs with PDL, median us per layer:

  engine      the engine's kernels: gemv(gated) then gemv(down, partial sums), tiles as
              given (start-up selection's choice at 64 rows by default)
  two         this probe's simple tile loops, one launch per projection (one program
              per gate/up tile and per down unit: 224 and 128 with the default tiles)
  fused       the same loops in one launch of as many programs as are resident at once
              (at most two a multiprocessor): each does its gate/up tiles, arrives at a
              counter, asks L2 for the first lines of its first down tile, waits for every
              program's arrival, then does its down units
  fused, no prefetch   the same without the L2 request

`two` against `fused` is the boundary's cost with the tile code held equal; `engine`
against `two` says how far the probe's loops are from the engine's tuned tiles. The
outputs are compared (fused and two against engine, bf16 rounding apart). Needs CUDA.

    PYTHONPATH=src python scripts/persistent_mlp_probe.py --out $OUT/mlp
    PYTHONPATH=src python scripts/persistent_mlp_probe.py --tiles 128,64,64,128,4 --rounds 5 \
        --out $OUT/mlp
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from l2_prefetch_probe import time_graph

from specserve.layers import pdl
from specserve.layers.gemv import GemvConfig, gemv
from specserve.layers.pdl_kernel import pdl_enter, prefetch_l2

M, HIDDEN, INTER = 64, 4096, 14336


@triton.jit
def _gate_up_tile(x, wgu, h, t, rows, NH: tl.constexpr, K1: tl.constexpr,
                  BN1: tl.constexpr, BK1: tl.constexpr):  # fmt: skip
    n = t * BN1 + tl.arange(0, BN1)
    acc_g = tl.zeros([64, BN1], dtype=tl.float32)
    acc_u = tl.zeros([64, BN1], dtype=tl.float32)
    for kk in range(0, K1, BK1):
        k = kk + tl.arange(0, BK1)
        xt = tl.load(x + rows[:, None] * K1 + k[None, :])
        wg = tl.load(wgu + n[:, None].to(tl.int64) * K1 + k[None, :])
        wu = tl.load(wgu + (n + NH)[:, None].to(tl.int64) * K1 + k[None, :])
        acc_g = tl.dot(xt, tl.trans(wg), acc_g)
        acc_u = tl.dot(xt, tl.trans(wu), acc_u)
    g = acc_g.to(h.dtype.element_ty).to(tl.float32)
    u = acc_u.to(h.dtype.element_ty).to(tl.float32)
    out = g / (1.0 + tl.exp(-g)) * u
    tl.store(h + rows[:, None] * NH + n[None, :], out.to(h.dtype.element_ty))


@triton.jit
def _down_unit(h, wd, part, u, rows, NH: tl.constexpr, N2: tl.constexpr, SPLIT2: tl.constexpr,
               BN2: tl.constexpr, BK2: tl.constexpr):  # fmt: skip
    nt = u // SPLIT2
    s = u % SPLIT2
    n = nt * BN2 + tl.arange(0, BN2)
    k0 = s * (NH // SPLIT2)
    acc = tl.zeros([64, BN2], dtype=tl.float32)
    for kk in range(k0, k0 + NH // SPLIT2, BK2):
        k = kk + tl.arange(0, BK2)
        ht = tl.load(h + rows[:, None] * NH + k[None, :], cache_modifier=".cg")
        wt = tl.load(wd + n[:, None].to(tl.int64) * NH + k[None, :])
        acc = tl.dot(ht, tl.trans(wt), acc)
    tl.store(part + s * 64 * N2 + rows[:, None] * N2 + n[None, :], acc)


@triton.jit
def _mlp_kernel(x, wgu, h, wd, part, counter, NH: tl.constexpr, K1: tl.constexpr,
                N2: tl.constexpr, SPLIT2: tl.constexpr, BN1: tl.constexpr,
                BK1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
                PHASE: tl.constexpr, PREFETCH: tl.constexpr,
                USE_PDL: tl.constexpr = False):  # fmt: skip
    """PHASE 1: gate/up tiles only; 2: down units only; 0: both, with a grid barrier."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rows = tl.arange(0, 64)
    if USE_PDL:
        pdl_enter()
    if PHASE != 2:
        for t in range(pid, NH // BN1, nprog):
            _gate_up_tile(x, wgu, h, t, rows, NH, K1, BN1, BK1)
    if PHASE == 0:
        if PREFETCH:
            if pid < (N2 // BN2) * SPLIT2:  # programs with a down unit
                nt = pid // SPLIT2
                k0 = (pid % SPLIT2) * (NH // SPLIT2)
                n = nt * BN2 + tl.arange(0, BN2)
                line = tl.arange(0, 8) * 64  # 128-byte lines of bf16
                prefetch_l2(wd + n[:, None].to(tl.int64) * NH + k0 + line[None, :])
        tl.debug_barrier()  # every thread's h stores before the arrival
        tl.atomic_add(counter, 1, sem="release")
        seen = tl.atomic_add(counter, 0, sem="acquire")
        spins = 0
        while (seen < nprog) & (spins < 4_000_000):  # bounded: a wrong grid fails, not hangs
            seen = tl.atomic_add(counter, 0, sem="acquire")
            spins += 1
    if PHASE != 1:
        for u in range(pid, (N2 // BN2) * SPLIT2, nprog):
            _down_unit(h, wd, part, u, rows, NH, N2, SPLIT2, BN2, BK2)


def _consts(x, tiles: dict) -> dict:
    return dict(NH=INTER, K1=HIDDEN, N2=HIDDEN, SPLIT2=2, BN1=tiles["bn1"], BK1=tiles["bk1"],
                BN2=tiles["bn2"], BK2=tiles["bk2"], num_warps=4, num_stages=tiles["stages"],
                **pdl.launch_options(x.device))  # fmt: skip


def fused_programs(x, wgu, h, wd, part, counter, sms: int, tiles: dict) -> tuple[int, dict]:
    """Programs of the fused launch: as many as are resident at once, at most two a
    multiprocessor (the barrier needs every program resident), from the compiled kernel's
    registers and shared memory (the build that asks L2 for lines; the one that does not
    runs the same loops with no more of either)."""
    kernel = _mlp_kernel.warmup(x, wgu, h, wd, part, counter, PHASE=0, PREFETCH=True,
                                grid=(1,), **_consts(x, tiles))  # fmt: skip
    kernel._init_handles()
    regs, smem = kernel.n_regs, kernel.metadata.shared
    per_sm = min(65536 // max(1, regs * 128), (228 << 10) // (smem + 1024), 2)
    return sms * per_sm, dict(regs=regs, shared=smem, per_sm=per_sm)


def launch(mode: str, x, wgu, h, wd, part, counter, programs: int, tiles: dict) -> None:
    common = _consts(x, tiles)
    args = (x, wgu, h, wd, part, counter)
    if mode == "two":
        _mlp_kernel[(INTER // tiles["bn1"],)](*args, PHASE=1, PREFETCH=False, **common)
        _mlp_kernel[(HIDDEN // tiles["bn2"] * 2,)](*args, PHASE=2, PREFETCH=False, **common)
    else:
        _mlp_kernel[(programs,)](*args, PHASE=0, PREFETCH=mode == "fused", **common)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("mlp"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every mode")
    # the gated kernel's tile: gated_config (half the width) of the plan's n128 k64 choice
    ap.add_argument("--gate-up", default="64,64,4,4", help="engine gated tile: n,k,warps,stages")
    ap.add_argument("--down", default="64,128,2,4,5", help="engine tile: n,k,split,warps,st")
    ap.add_argument("--tiles", default="64,64,64,128,3", help="probe: bn1,bk1,bn2,bk2,stages")
    args = ap.parse_args()
    dev = torch.device("cuda")
    pdl.set_enabled(True)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bf = dict(device=dev, dtype=torch.bfloat16)
    x = torch.randn(M, HIDDEN, **bf) * 0.5
    wgus = [torch.randn(2 * INTER, HIDDEN, **bf) * 0.02 for _ in range(args.layers)]
    wds = [torch.randn(HIDDEN, INTER, **bf) * 0.02 for _ in range(args.layers)]
    h = torch.empty(M, INTER, **bf)
    part = torch.empty(2, M, HIDDEN, device=dev, dtype=torch.float32)
    counters = torch.zeros(args.layers, device=dev, dtype=torch.int32)
    n, k, w, st = (int(v) for v in args.gate_up.split(","))
    cfg_gu = GemvConfig(n, k, num_warps=w, num_stages=st, block_m=64)
    n, k, s, w, st = (int(v) for v in args.down.split(","))
    cfg_down = GemvConfig(n, k, split_k=s, num_warps=w, num_stages=st, block_m=64)
    bn1, bk1, bn2, bk2, stages = (int(v) for v in args.tiles.split(","))
    tiles = dict(bn1=bn1, bk1=bk1, bn2=bn2, bk2=bk2, stages=stages)

    def engine(i):
        if i == 0:
            counters.zero_()  # (in every graph, so that all pay it)
        hh = gemv(x, wgus[i], config=cfg_gu, gated=True)
        return gemv(hh, wds[i], config=cfg_down, defer_reduce=True)

    programs, occupancy = fused_programs(x, wgus[0], h, wds[0], part, counters, sms, tiles)

    def probe(mode):
        def fn(i):
            if i == 0:
                counters.zero_()
            launch(mode, x, wgus[i], h, wds[i], part, counters[i:], programs, tiles)

        return fn

    result = dict(device=torch.cuda.get_device_name(), sms=sms, layers=args.layers,
                  engine_tiles=[str(cfg_gu), str(cfg_down)], probe_tiles=tiles,
                  fused_programs=programs, fused_kernel=occupancy)  # fmt: skip
    print(json.dumps(result), flush=True)
    ref = engine(0).partials.sum(0)
    checks = {}
    for mode in ("two", "fused", "fused, no prefetch"):
        counters.zero_()
        launch(mode, x, wgus[0], h, wds[0], part, counters, programs, tiles)
        checks[mode] = float(((part.sum(0) - ref).abs().max() / ref.abs().max()).item())
    print(json.dumps(checks), flush=True)
    result["max_rel_diff_vs_engine"] = checks
    times: dict[str, list[float]] = {m: [] for m in ("engine", "two", "fused",
                                                     "fused, no prefetch")}  # fmt: skip
    for _ in range(args.rounds):  # interleaved
        times["engine"].append(time_graph(engine, args.layers, args.reps))
        for mode in ("two", "fused", "fused, no prefetch"):
            times[mode].append(time_graph(probe(mode), args.layers, args.reps))
    result["us_per_layer"] = {m: [round(t, 2) for t in v] for m, v in times.items()}
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    name = "persistent_mlp_probe_" + args.tiles.replace(",", "_") + ".json"
    (args.out / name).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
