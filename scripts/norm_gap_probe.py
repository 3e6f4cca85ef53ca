"""Probe: what do the two add + RMSNorm kernels of a decoder layer cost a batch-1 step, on
the critical path between the weight GEMVs, under CUDA graphs and PDL? It bounds what
folding a norm into the next GEMV's prologue could save.

A layer-like chain without attention (qkv, o from the first 4096 qkv columns, gate_up, down),
over rotating weights of the Llama-3.1-8B shape, GEMV configurations chosen by start-up
selection for one row; timed in a CUDA graph (median us per layer):
  full          as the engine runs it: add+norm, qkv, o (its K split's pass in the norm),
                add+norm, gate_up, SiLU-and-mul, down (its pass in the next add+norm)
  full+norms    the same with each norm kernel run twice (the second's output used): the
                difference is what one more pair of norm kernels costs in the chain
  unsplit       o and down through unsplit configurations, norms as in full
  unsplit-norms the same chain with no norm kernels at all (GEMVs read the previous output)
  full, gated gate_up   full with SiLU-and-mul in the gate/up GEMV's epilogue (gemv
                `gated`, the tile of half the chosen width), when Triton serves gate/up
  NAME=CFG      the engine's chain (down with SiLU-and-mul as its prologue where Triton
                serves it) with one projection through another configuration ("torch":
                cuBLAS; --extra-splits adds K-split tiles that selection does not propose):
                does a kernel timed alone rank the same between its neighbours?

    PYTHONPATH=src python scripts/norm_gap_probe.py --out $OUT/normprobe
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch
import triton
from argmax_bench import replay_us

from specserve.layers import pdl
from specserve.layers.gemv import SplitKSum, gemv
from specserve.layers.gemv_configs import GemvConfig
from specserve.layers.gemv_select import GemvSelector, bucket_candidates
from specserve.layers.triton_ops import add_rms_norm, silu_and_mul, split_k_add_rms_norm

EPS = 1e-5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="normprobe")
    ap.add_argument("--rot", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--extra-splits", type=lambda v: tuple(map(int, v.split(","))), nargs="*",
                    default=[], help="more tiles to try in the chain: "
                    "BLOCK_N,SPLIT,STAGES[,BLOCK_K[,WARPS[,TMA]]] (BLOCK_K 128, 4 warps)")
    args = ap.parse_args()
    pdl.set_enabled(True)
    dev, dt = torch.device("cuda"), torch.bfloat16
    h, inter = 4096, 14336
    shapes = {"qkv": (6144, h), "o": (h, h), "gate_up": (2 * inter, h), "down": (h, inter)}
    layers = [{name: torch.randn(n, k, device=dev, dtype=dt) * 0.02
               for name, (n, k) in shapes.items()} for _ in range(args.rot)]  # fmt: skip
    nw = torch.ones(h, device=dev, dtype=dt)
    sel = GemvSelector(row_buckets=(args.rows,), budget_s=20)
    plan = sel.select({(n, k, dt): [L[name] for L in layers] for name, (n, k) in shapes.items()})
    cfg = {name: plan.config_for(args.rows, n, k, dt) for name, (n, k) in shapes.items()}
    unsplit = GemvConfig(32, 256, num_warps=4, num_stages=4)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print("configs", {k: str(v) for k, v in cfg.items()}, flush=True)

    def proj(x, w, c, defer=False):
        if c is None:
            return torch.nn.functional.linear(x, w)
        return gemv(x, w, None, c, defer_reduce=defer)

    def norm(y, r, twice):
        if isinstance(y, SplitKSum):
            r2, out = split_k_add_rms_norm(y, r, nw, EPS)
        else:
            r2, out = add_rms_norm(y, r, nw, EPS)
        if twice:
            r2, out = add_rms_norm(out, r, nw, EPS)
        return out, r2

    x0 = torch.randn(args.rows, h, device=dev, dtype=dt)
    r0 = torch.randn(args.rows, h, device=dev, dtype=dt)
    state = {}

    def layer(i, twice=False, o_cfg=None, down_cfg=None, norms=True, fused_silu=False,
              over=None, gated=False):
        L = layers[i]
        x, r = state.get("x", x0), state.get("r", r0)
        c = {**cfg, **(over or {})}
        o_cfg = o_cfg or c["o"]
        down_cfg = down_cfg or c["down"]
        if norms:
            hdn, r = norm(x, r, twice)
        else:
            hdn = x.reduce() if isinstance(x, SplitKSum) else x
        qkv = proj(hdn, L["qkv"], c["qkv"])
        o = proj(qkv[:, :h], L["o"], o_cfg, defer=norms)
        if norms:
            hdn, r = norm(o, r, twice)
        else:
            hdn = o
        if gated:  # SiLU-and-mul in the gate/up epilogue, the tile of half the width
            half = replace(c["gate_up"], block_n=c["gate_up"].block_n // 2)
            a = gemv(hdn, L["gate_up"], None, half, gated=True)
            state["x"] = proj(a, L["down"], down_cfg, defer=norms)
            state["r"] = r
            return
        gu = proj(hdn, L["gate_up"], c["gate_up"])
        if fused_silu and down_cfg is not None:
            state["x"] = gemv(gu, L["down"], None, down_cfg, silu=True, defer_reduce=norms)
        else:
            a = silu_and_mul(gu[:, :inter], gu[:, inter:])
            state["x"] = proj(a, L["down"], down_cfg, defer=norms)
        state["r"] = r

    def time_chain(**kw) -> float:
        state.clear()
        for i in range(args.rot):
            layer(i, **kw)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        state.clear()
        with torch.cuda.graph(graph):
            for i in range(args.rot):
                layer(i, **kw)
        graph.replay()
        torch.cuda.synchronize()
        return replay_us(graph, args.rot, 20)

    results = {"device": torch.cuda.get_device_name(), "rows": args.rows,
               "configs": {k: str(v) for k, v in cfg.items()}}  # fmt: skip
    for rnd in range(2):
        r = {
            "full": time_chain(),
            "full+norms": time_chain(twice=True),
            "unsplit": time_chain(o_cfg=unsplit, down_cfg=unsplit),
            "unsplit-norms": time_chain(o_cfg=unsplit, down_cfg=unsplit, norms=False),
        }  # fmt: skip
        r["one_more_norm_pair_us"] = r["full+norms"] - r["full"]
        r["norms_in_unsplit_us"] = r["unsplit"] - r["unsplit-norms"]
        r["engine"] = time_chain(fused_silu=True)
        gu = cfg["gate_up"]
        if gu is not None and gu.use_dot and gu.split_k == 1 and gu.block_n >= 32:
            try:
                r["full, gated gate_up"] = time_chain(gated=True)
            except triton.runtime.errors.OutOfResources as e:
                print(f"gated gate_up: {e}", flush=True)
        for name, (n, k) in shapes.items():
            (_, cands), = bucket_candidates((args.rows,), n, k, sms)
            bm = cands[-1].block_m if cands else 16
            extra = [GemvConfig(bn, (*more, 128)[0], split_k=sk, num_stages=st, block_m=bm,
                                num_warps=(*more[1:], 4)[0], tma=bool((*more[2:], 0)[0]))
                     for bn, sk, st, *more in args.extra_splits]  # fmt: skip
            for alt in [None, *cands, *(c for c in extra if c.supports(args.rows, n, k))]:
                if alt != cfg[name]:
                    try:
                        r[f"{name}={alt or 'torch'}"] = time_chain(fused_silu=True,
                                                                   over={name: alt})
                    except triton.runtime.errors.OutOfResources as e:  # a tile too large
                        print(f"{name}={alt}: {e}", flush=True)
        results[f"round{rnd}"] = r = {k: round(v, 2) for k, v in r.items()}
        print(f"round{rnd}", json.dumps(r), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"norm_gap_probe_m{args.rows}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
