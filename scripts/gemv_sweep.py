"""A wide sweep of the Triton GEMV's launch configurations at decode shapes of the
Llama-3.1-8B-shaped target and its EAGLE-3 head: the tiles, warps, pipeline depths and K
splits that start-up selection does not propose, to find what its candidate list misses
(`gemv_configs.candidate_configs`). Per (shape, M): torch (cuBLAS), the best start-up
candidate and the best six of the sweep, device time in CUDA graphs over weights that
overflow L2 (as start-up selection times them). Needs CUDA.

    PYTHONPATH=src python scripts/gemv_sweep.py --out $OUT/gemv_sweep
    PYTHONPATH=src python scripts/gemv_sweep.py --rows 64 --shapes o qkv --out $OUT/s
    PYTHONPATH=src python scripts/gemv_sweep.py --rows 64 --shapes o qkv --tma 0 1 \
        --block-n 64 128 --block-k 64 128 --warps 4 --stages 3 4 5 --splits 1 2 --out $OUT/s
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from specserve.layers.gemv import GemvConfig, candidate_configs, gemv, row_block, row_blocks
from specserve.layers.gemv_select import rotation_set, time_in_graph_us, variant_key

SHAPES = {  # name -> (N, K)
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    "lm_head": (128256, 4096), "eagle_fc": (4096, 12288), "eagle_qkv": (6144, 8192),
}  # fmt: skip
SPLITS = (1, 2, 3, 4, 6, 8)
H200_SMS = 132  # the program-count cap: 16 waves of the sweep's GPU
SMEM_BYTES = 220 * 1024  # H200: 227 KB of shared memory per block, less Triton's own use


GRID = dict(block_n=(16, 32, 64, 128, 256), block_k=(64, 128, 256, 512), warps=(2, 4, 8),
            stages=(3, 4, 5))  # fmt: skip


def sweep_configs(rows: int, n: int, k: int, grid: dict = GRID) -> list[GemvConfig]:
    """Every tile / warps / stages / split combination of `grid` that fits shared memory
    and keeps each K slice at least one block long and the program count within 16 waves;
    each with pointer loads of the weight and, where grid["tma"] lists True, with tensor-
    descriptor loads too."""
    bm = row_block(rows)
    out = []
    for bn, bk, warps, stages in itertools.product(grid["block_n"], grid["block_k"],
                                                   grid["warps"], grid["stages"]):  # fmt: skip
        if not 2048 <= bn * bk <= 65536 or (warps == 2 and bn * bk > 4096):
            continue
        if stages * (bm + bn) * bk * 2 > SMEM_BYTES:
            continue
        for split, tma in itertools.product(grid.get("splits", SPLITS), grid.get("tma", [0])):
            cfg = GemvConfig(bn, bk, split, warps, stages, True, bm, tma=bool(tma))
            if cfg.supports(rows, n, k) and triton.cdiv(n, bn) * split <= 16 * H200_SMS:
                out.append(cfg)
    return out


def compile_all(cases, workers: int) -> float:
    """Compile every distinct variant of `cases` [(cfg, rows, weight)] in parallel."""
    tasks = {}
    for cfg, rows, w in cases:
        blocks = row_blocks(cfg, rows, w.element_size())
        tasks.setdefault(variant_key(cfg, rows, *w.shape, w.dtype, blocks=blocks), (cfg, rows, w))
    t0 = time.perf_counter()

    def build(task):
        cfg, rows, w = task
        try:
            gemv(torch.zeros(rows, w.shape[1], device=w.device, dtype=w.dtype), w, None, cfg,
                 compile_only=True)  # fmt: skip
        except Exception as e:  # timed as failing later
            print("compile failed", cfg, e, flush=True)

    first, *rest = tasks.values()
    build(first)
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(build, rest))
    return time.perf_counter() - t0


def measure(cfg: GemvConfig | None, x: torch.Tensor, rotation, reps: int) -> float:
    fn = F.linear if cfg is None else (lambda x, w: gemv(x, w, None, cfg))
    try:
        fn(x, rotation[0])
        torch.cuda.synchronize()
    except Exception:
        return float("inf")
    return time_in_graph_us(fn, x, rotation, reps)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="folder for gemv_sweep.json (GPU runs)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 64])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=400.0)
    for name, values in GRID.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, nargs="+", default=values)
    ap.add_argument("--splits", type=int, nargs="+", default=SPLITS)
    ap.add_argument("--tma", type=int, nargs="+", default=[0], choices=[0, 1],
                    help="weight loads: 0 pointers, 1 tensor descriptors (both: 0 1)")
    ap.add_argument("--tiny", action="store_true",
                    help="list the configurations of a small grid and exit (no GPU)")
    args = ap.parse_args()
    grid = {name: getattr(args, name) for name in (*GRID, "splits", "tma")}
    if args.tiny:  # CPU smoke: what the grid would time
        for s in args.shapes:
            for m in args.rows:
                configs = sweep_configs(m, *SHAPES[s], grid)
                print(s, m, len(configs), *map(str, configs[:3]), sep=" | ")
        return
    if args.out is None:
        ap.error("--out is required (except with --tiny)")
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.budget_s
    dt = torch.bfloat16
    props = torch.cuda.get_device_properties(0)
    min_bytes = 4 * getattr(props, "L2_cache_size", 64 << 20)
    weights = {s: torch.empty(SHAPES[s], device="cuda", dtype=dt).normal_(0, 0.02)
               for s in args.shapes}  # fmt: skip
    cases = [(cfg, m, weights[s]) for s in args.shapes for m in args.rows
             for cfg in sweep_configs(m, *SHAPES[s], grid)]  # fmt: skip
    compile_s = compile_all(cases, args.workers)
    print(f"{len(cases)} cases compiled in {compile_s:.1f} s", flush=True)
    rows_out = []
    for s in args.shapes:
        n, k = SHAPES[s]
        rotation = rotation_set([weights[s]], min_bytes)
        gb = n * k * 2 / 1e3
        for m in args.rows:
            if time.perf_counter() > deadline:
                print("deadline: skipping", s, m, flush=True)
                continue
            x = torch.randn(m, k, device="cuda", dtype=dt)
            torch_us = measure(None, x, rotation, args.reps)
            start = {
                str(c): measure(c, x, rotation, args.reps)
                for c in candidate_configs(m, n, k, props.multi_processor_count)
            }
            cfg_of = {str(c): c for c in sweep_configs(m, n, k, grid)}
            swept = [(measure(c, x, rotation, args.reps), s_) for s_, c in cfg_of.items()]
            swept.sort()  # the leaders again, with more replays (less noise)
            leaders = sorted(
                (measure(cfg_of[c], x, rotation, 3 * args.reps), c) for _, c in swept[:10]
            )
            best_start = min(start.items(), key=lambda kv: kv[1])
            row = dict(shape=s, n=n, k=k, m=m, torch_us=round(torch_us, 2),
                       torch_gbps=round(gb / torch_us, 1),
                       start_best=best_start[0], start_us=round(best_start[1], 2),
                       swept=len(swept),  # configurations timed, not just the leaders
                       top=[dict(config=c, us=round(us, 2), gbps=round(gb / us, 1))
                            for us, c in leaders[:6]])  # fmt: skip
            rows_out.append(row)
            print(json.dumps(row), flush=True)
            (args.out / "gemv_sweep.json").write_text(
                json.dumps(
                    dict(device=props.name, compile_s=round(compile_s, 1), rows=rows_out), indent=1
                )
            )
        del rotation
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
