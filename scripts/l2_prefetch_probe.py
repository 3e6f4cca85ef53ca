"""Probe: at batch 1 the HBM idles through the attention chain (rotary + K/V store, decode
attention, split merge: ~10 us per layer, latency-bound), and then the o projection streams
its 33.5 MB of weights at ~3 TB/s. Does asking L2 for those weights at the start of the
chain (bulk L2 prefetches from a few dozen programs) shorten the o projection?

Per layer-like iteration, each over its own weights and caches (a rotation that overflows
L2), timed in CUDA graphs (median us per iteration):
  chain      rotary + K/V store, decode attention (split), o projection (the engine's kernels)
  chain+pf   the same after a prefetch kernel for this iteration's o weight
  attn       the chain without the o projection;  attn+pf: with the prefetch kernel
  o_cold     the o projection alone over rotating weights;  o_hot: one weight, L2-resident
  chain+side the prefetch kernel on a second stream, forked before the attention chain and
             joined after the o projection, so it runs beside the chain, not in it
  attn+side  the same without the o projection
So chain - attn is the o projection's share, and chain+pf - attn+pf its share with the
prefetch. Needs CUDA (sm_90: cp.async.bulk.prefetch.L2).

    PYTHONPATH=src python scripts/l2_prefetch_probe.py --out $OUT/l2probe
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from argmax_bench import replay_us

from specserve.layers import pdl
from specserve.layers.attention.triton_kernels import paged_attention
from specserve.layers.gemv import gemv
from specserve.layers.gemv_configs import GemvConfig
from specserve.layers.triton_rotary import rotary_store_kv

CHUNK = 16384  # bytes per bulk prefetch
PER_PROGRAM = 32  # bulk prefetches per program (512 KB)


@triton.jit
def _bulk_prefetch_kernel(w_ptr, n_bytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    pid = tl.program_id(0)
    offs = (pid * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * CHUNK
    ok = offs < n_bytes
    size = tl.minimum(n_bytes - offs, CHUNK).to(tl.int32)
    addr = w_ptr.to(tl.pointer_type(tl.int8)) + offs
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, size, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _line_prefetch_kernel(w_ptr, n_bytes, LINES: tl.constexpr):
    """Each thread asks L2 for LINES 128-byte lines (prefetch.global.L2, one per line)."""
    pid = tl.program_id(0)
    offs = (pid * LINES + tl.arange(0, LINES)).to(tl.int64) * 128
    addr = w_ptr.to(tl.pointer_type(tl.int8)) + tl.minimum(offs, n_bytes - 128)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [addr],
                              dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


# name -> (kind, bytes or lines per instruction, instructions per program, warps)
VARIANTS = {"bulk16k x32 w1": ("bulk", 16384, 32, 1), "bulk16k x4 w1": ("bulk", 16384, 4, 1),
            "bulk64k x1 w1": ("bulk", 65536, 1, 1), "bulk64k x8 w1": ("bulk", 65536, 8, 1),
            "lines 256/cta w2": ("lines", 0, 256, 2), "lines 2048/cta w8": ("lines", 0, 2048, 8)}
VARIANT = ["bulk16k x32 w1"]


def prefetch(w: torch.Tensor) -> None:
    n = w.numel() * w.element_size()
    kind, chunk, per_program, warps = VARIANTS[VARIANT[0]]
    if kind == "bulk":
        _bulk_prefetch_kernel[(triton.cdiv(n, chunk * per_program),)](
            w, n, CHUNK=chunk, PER_PROGRAM=per_program, num_warps=warps)
    else:
        _line_prefetch_kernel[(triton.cdiv(n, 128 * per_program),)](
            w, n, LINES=per_program, num_warps=warps)


def time_graph(fn, iters: int, reps: int = 20) -> float:
    """Median us per iteration of a graph calling fn(i) for i in range(iters)."""
    for i in range(iters):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    return replay_us(graph, iters, reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="l2probe")
    ap.add_argument("--ctx", type=int, default=768)
    ap.add_argument("--splits", type=int, default=6)
    ap.add_argument("--rot", type=int, default=12)
    ap.add_argument("--variants", action="store_true",
                    help="compare prefetch kernels of other shapes (VARIANTS) instead")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    heads, kvh, d, hidden, page = 32, 8, 128, 4096, 16
    pages = args.ctx // page
    cfgs = {"o_triton": GemvConfig(32, 128, split_k=3, num_warps=2, num_stages=4, block_m=16),
            "o_torch": None}
    cos_sin = torch.randn(args.ctx + 1, d, device=dev, dtype=torch.float32)
    i64 = dict(dtype=torch.int64, device=dev)
    pos = torch.tensor([args.ctx - 1], **i64)
    slots = torch.tensor([args.ctx - 1], **i64)
    qsl, seq = torch.tensor([0, 1], **i64), torch.tensor([args.ctx], **i64)
    table = torch.arange(pages, **i64)[None]
    layers = []
    for _ in range(args.rot):
        layers.append(dict(
            qkv=torch.randn(1, (heads + 2 * kvh) * d, device=dev, dtype=dt),
            k=torch.randn(pages, page, kvh, d, device=dev, dtype=dt),
            v=torch.randn(pages, page, kvh, d, device=dev, dtype=dt),
            wo=torch.randn(hidden, hidden, device=dev, dtype=dt) * 0.02))

    def attn(i):
        L = layers[i]
        q = rotary_store_kv(pos, L["qkv"], cos_sin, heads, kvh, L["k"], L["v"], slots)
        return paged_attention(q, L["k"], L["v"], pos, qsl, seq, table, 1, d ** -0.5,
                               num_splits=args.splits, block_n=32, num_warps=4, num_stages=3)

    def o_proj(x, w, cfg):
        x = x.reshape(1, hidden)
        return torch.nn.functional.linear(x, w) if cfg is None else gemv(x, w, None, cfg)

    x0 = torch.randn(1, hidden, device=dev, dtype=dt)
    side = torch.cuda.Stream()

    def beside(i, fn):
        """fn(i) on the current stream with the prefetch of layer i's o weight beside it."""
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prefetch(layers[i]["wo"])
        out = fn(i)
        main.wait_stream(side)
        return out

    def measure(cfg) -> dict:
        r = {
            "chain": time_graph(lambda i: o_proj(attn(i), layers[i]["wo"], cfg), args.rot),
            "chain+pf": time_graph(lambda i: (prefetch(layers[i]["wo"]),
                                              o_proj(attn(i), layers[i]["wo"], cfg)), args.rot),
            "attn": time_graph(attn, args.rot),
            "attn+pf": time_graph(lambda i: (prefetch(layers[i]["wo"]), attn(i)), args.rot),
            "o_cold": time_graph(lambda i: o_proj(x0, layers[i]["wo"], cfg), args.rot),
            "o_hot": time_graph(lambda i: o_proj(x0, layers[0]["wo"], cfg), args.rot),
            "pf_only": time_graph(lambda i: prefetch(layers[i]["wo"]), args.rot),
            "chain+side": time_graph(lambda i: beside(
                i, lambda j: o_proj(attn(j), layers[j]["wo"], cfg)), args.rot),
            "attn+side": time_graph(lambda i: beside(i, attn), args.rot),
        }  # fmt: skip
        r["gain_side_us"] = r["chain"] - r["chain+side"]
        r["o_share"] = r["chain"] - r["attn"]
        r["o_share_pf"] = r["chain+pf"] - r["attn+pf"]
        r["gain_us"] = r["chain"] - r["chain+pf"]
        return {k: round(v, 2) for k, v in r.items()}

    results = {"device": torch.cuda.get_device_name(), "ctx": args.ctx, "splits": args.splits}
    if args.variants:  # prefetch kernels of other shapes, Triton o projection, PDL on
        pdl.set_enabled(True)
        for v in VARIANTS:
            VARIANT[0] = v
            results[f"o_triton {v}"] = r = measure(cfgs["o_triton"])
            print(v, json.dumps(r), flush=True)
    for use_pdl in () if args.variants else (True, False):
        pdl.set_enabled(use_pdl)
        for name, cfg in cfgs.items():
            results[f"{name} pdl={use_pdl}"] = r = measure(cfg)
            print(name, "pdl", use_pdl, json.dumps(r), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "l2_prefetch_variants.json" if args.variants else "l2_prefetch_probe.json"
    (out / name).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
