"""Probe: where the attention chain's time goes on the GPU (batch 1 unless --batch). Per
layer-like iteration (each over its own KV cache: a rotation that overflows L2), timed in
CUDA graphs with PDL as the engine launches them, median us per iteration: the rotary + K/V
store kernel alone, decode attention alone at each split count (its merge kernel included),
and the two together. Query lengths 1 (decode) and 4 (verify of 3 drafts). Needs CUDA.
(Session 7 also timed the splits merged by the decode kernel itself, an experiment since removed:
docs/benchmarks/gpu_pdl.md, run 3.)

    PYTHONPATH=src python scripts/attn_chain_probe.py --out $OUT/chain
    PYTHONPATH=src python scripts/attn_chain_probe.py --batch 64 --ctx 640 --splits 1 2 \
        --rot 8 --out $OUT/chain64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from l2_prefetch_probe import time_graph

from specserve.layers import pdl
from specserve.layers.attention.triton_kernels import paged_attention
from specserve.layers.triton_rotary import rotary_store_kv

HEADS = 32


def probe_row(q_len: int, args, caches, cos_sin) -> dict:
    """The row of timings for requests of `q_len` new tokens."""
    dev, dt = caches[0][0].device, caches[0][0].dtype
    heads, kvh, d = HEADS, caches[0][0].shape[2], caches[0][0].shape[3]
    i64 = dict(dtype=torch.int64, device=dev)
    b, page = args.batch, caches[0][0].shape[1]
    table = torch.arange(caches[0][0].shape[0], **i64).view(b, -1)  # each request its pages
    seq = torch.full((b,), args.ctx, **i64)
    pos = torch.arange(args.ctx - q_len, args.ctx, **i64).repeat(b)
    slots = pos + torch.arange(b, **i64).repeat_interleave(q_len) * table.shape[1] * page
    qsl = torch.arange(b + 1, **i64) * q_len
    rows = b * q_len
    qkvs = [torch.randn(rows, (heads + 2 * kvh) * d, device=dev, dtype=dt)
            for _ in range(args.rot)]  # fmt: skip
    qs = [torch.randn(rows, heads, d, device=dev, dtype=dt) for _ in range(args.rot)]

    def rot(i):
        return rotary_store_kv(pos, qkvs[i], cos_sin, heads, kvh, *caches[i], slots)

    def attend(q, i, splits, **kw):
        return paged_attention(q, *caches[i], pos, qsl, seq, table, q_len, d ** -0.5,
                               num_splits=splits, block_n=32, num_warps=4, num_stages=3,
                               **kw)  # fmt: skip

    row = {"rot": time_graph(rot, args.rot)}
    for s in args.splits:
        row[f"attn s{s}"] = time_graph(lambda i, s=s: attend(qs[i], i, s), args.rot)
        row[f"chain s{s}"] = time_graph(lambda i, s=s: attend(rot(i), i, s), args.rot)
    return {k: round(v, 2) for k, v in row.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="chain")
    ap.add_argument("--ctx", type=int, default=768)
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    ap.add_argument("--rot", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1, help="requests, each over its own pages")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    kvh, d, page = 8, 128, 16
    pages = args.batch * -(-args.ctx // page)
    cos_sin = torch.randn(args.ctx + 1, d, device=dev, dtype=torch.float32)
    caches = [(torch.randn(pages, page, kvh, d, device=dev, dtype=dt),
               torch.randn(pages, page, kvh, d, device=dev, dtype=dt)) for _ in range(args.rot)]
    pdl.set_enabled(True)
    results: dict = {"device": torch.cuda.get_device_name(), "ctx": args.ctx,
                     "batch": args.batch, "rows": {}}  # fmt: skip
    for q_len in (1, 4):
        results["rows"][q_len] = row = probe_row(q_len, args, caches, cos_sin)
        print("q_len", q_len, json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attn_chain_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
