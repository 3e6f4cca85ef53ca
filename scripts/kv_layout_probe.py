"""Probe: does the paged KV layout limit decode attention's bandwidth? The pool stores a page
as [page_size, kv_heads, head_dim] (token-major: one (page, head) is page_size rows of 256
bytes, 2 KB apart); head-major [kv_heads, page_size, head_dim] makes each (page, head) one
contiguous run (4 KB at page 16). The attention kernel reads the cache through its strides,
so a head-major pool is passed as a transposed view; nothing else changes.

Decode attention (the engine's launch configuration and split policy under CUDA graphs:
batch 1 splits 32 ways, batch 64 not at all) over `--layers` layers' caches in turn (more
than L2 holds), pages scattered at random as a long-running pool leaves them, timed in a
CUDA graph (median us per layer, GB/s of K and V read).

    PYTHONPATH=src python scripts/kv_layout_probe.py --out $OUT/kvlayout
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from argmax_bench import replay_us

from specserve.layers import pdl
from specserve.layers.attention import triton_kernels
from specserve.layers.attention.triton_attn import DECODE_LAUNCH
from specserve.layers.attention.triton_kernels import paged_attention

# The shipped check insists on the token-major layout; the kernels index through strides.
triton_kernels._check_cache = lambda k, v: None


def attention_steps(q, caches, meta, splits):
    """step(i): decode attention of q over layer i's cache, as the engine launches it."""

    def step(i):
        k, v = caches[i]
        return paged_attention(
            q, k, v, *meta, 1, q.shape[-1] ** -0.5, num_splits=splits,
            block_n=DECODE_LAUNCH.block_n, num_warps=DECODE_LAUNCH.num_warps,
            num_stages=DECODE_LAUNCH.num_stages)  # fmt: skip

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kvlayout")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ctx", type=int, nargs="+", default=[640, 2048])
    ap.add_argument("--page", type=int, nargs="+", default=[16, 64])
    args = ap.parse_args()
    pdl.set_enabled(True)
    dev, dt = torch.device("cuda"), torch.bfloat16
    heads, kvh, d = 32, 8, 128
    i64 = dict(dtype=torch.int64, device=dev)
    results = {"device": torch.cuda.get_device_name(), "rows": []}
    gen = torch.Generator().manual_seed(0)
    for batch, splits in ((1, 32), (64, 1)):
        for ctx in args.ctx:
            for page in args.page:
                per_req = -(-ctx // page)
                pages = batch * per_req + 1
                table = (torch.randperm(pages - 1, generator=gen)[: batch * per_req] + 1)
                table = table.view(batch, per_req).to(dev)
                pos = torch.full((batch,), ctx - 1, **i64)
                qsl = torch.arange(batch + 1, **i64)
                seq = torch.full((batch,), ctx, **i64)
                q = torch.randn(batch, heads, d, device=dev, dtype=dt)
                for layout in ("token-major", "head-major"):
                    caches = []
                    for _ in range(args.layers):
                        if layout == "token-major":
                            k = torch.randn(pages, page, kvh, d, device=dev, dtype=dt)
                            v = torch.randn(pages, page, kvh, d, device=dev, dtype=dt)
                        else:
                            k = torch.randn(pages, kvh, page, d, device=dev, dtype=dt)
                            v = torch.randn(pages, kvh, page, d, device=dev, dtype=dt)
                            k, v = k.transpose(1, 2), v.transpose(1, 2)
                        caches.append((k, v))

                    step = attention_steps(q, caches, (pos, qsl, seq, table), splits)
                    ref = step(0).float()
                    for i in range(args.layers):
                        step(i)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for i in range(args.layers):
                            step(i)
                    graph.replay()
                    torch.cuda.synchronize()
                    us = replay_us(graph, args.layers, 20)
                    gbs = batch * ctx * kvh * d * 2 * 2 / us / 1e3
                    row = dict(batch=batch, ctx=ctx, page=page, layout=layout, splits=splits,
                               us=round(us, 2), gb_s=round(gbs, 1),
                               checksum=round(ref.abs().sum().item(), 3))  # fmt: skip
                    results["rows"].append(row)
                    print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_layout_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
