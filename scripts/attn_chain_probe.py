"""Probe: where the batch-1 attention chain's time goes on the GPU. Per layer-like iteration
(each over its own KV cache: a rotation that overflows L2), timed in CUDA graphs with PDL
as the engine launches them, median us per iteration: the rotary + K/V store kernel alone
("rot"), decode attention alone at each split count, its merge kernel included ("attn sN"),
the two together ("chain sN"), and the decode kernel taking the qkv rows and doing the
rotary and K/V store itself ("rope sN": paged_attention(rope=), the engine's path when
triton_kernels.FUSED_ROPE is on). Query lengths 1 (decode) and 4 (verify of 3 drafts).
"bitwise" records, per query length and split count, whether "rope" leaves the same output
and caches as "chain" (one eager call each on copies of a cache). Needs CUDA; --tiny runs
the wiring on the CPU through the Triton interpreter (TRITON_INTERPRET=1; small shapes,
fp16, nothing timed). (Session 7 also timed the splits merged by the decode kernel itself,
an experiment since removed: docs/benchmarks/gpu_pdl.md, run 3.)

    PYTHONPATH=src python scripts/attn_chain_probe.py --out $OUT/chain
    TRITON_INTERPRET=1 PYTHONPATH=src python scripts/attn_chain_probe.py --tiny --out /tmp/chain
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from l2_prefetch_probe import time_graph

from specserve.layers import pdl
from specserve.layers.attention.triton_kernels import Rope, paged_attention
from specserve.layers.triton_rotary import rotary_store_kv


def probe_row(q_len: int, args, caches, cos_sin, heads: int, timer) -> tuple[dict, dict]:
    """The row of timings for requests of `q_len` new tokens, and the bitwise checks."""
    dev, dt = caches[0][0].device, caches[0][0].dtype
    kvh, d = caches[0][0].shape[2], caches[0][0].shape[3]
    i64 = dict(dtype=torch.int64, device=dev)
    table = torch.arange(caches[0][0].shape[0], **i64)[None]
    seq = torch.tensor([args.ctx], **i64)
    pos = torch.arange(args.ctx - q_len, args.ctx, **i64)  # the slots too: table is arange
    qsl = torch.tensor([0, q_len], **i64)
    qkvs = [torch.randn(q_len, (heads + 2 * kvh) * d, device=dev, dtype=dt)
            for _ in range(args.rot)]  # fmt: skip
    qs = [torch.randn(q_len, heads, d, device=dev, dtype=dt) for _ in range(args.rot)]
    rope = Rope(cos_sin, pos, heads)

    def rot(i, cache=None):
        return rotary_store_kv(pos, qkvs[i], cos_sin, heads, kvh, *(cache or caches[i]), pos)

    def attend(q, i, splits, cache=None, **kw):
        return paged_attention(q, *(cache or caches[i]), pos, qsl, seq, table, q_len,
                               d ** -0.5, num_splits=splits, block_n=32, num_warps=4,
                               num_stages=3, **kw)  # fmt: skip

    row = {"rot": timer(rot, args.rot)}
    bitwise = {}
    for s in args.splits:
        row[f"attn s{s}"] = timer(lambda i, s=s: attend(qs[i], i, s), args.rot)
        row[f"chain s{s}"] = timer(lambda i, s=s: attend(rot(i), i, s), args.rot)
        row[f"rope s{s}"] = timer(lambda i, s=s: attend(qkvs[i], i, s, rope=rope), args.rot)
        plain = tuple(c.clone() for c in caches[0])
        fused = tuple(c.clone() for c in caches[0])
        want = attend(rot(0, plain), 0, s, plain)
        got = attend(qkvs[0], 0, s, fused, rope=rope)
        bitwise[f"s{s}"] = all(torch.equal(a, b) for a, b in zip((got, *fused), (want, *plain)))
    return {k: round(v, 2) for k, v in row.items()}, bitwise


def _untimed(fn, iters: int) -> float:
    for i in range(iters):
        fn(i)
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="chain")
    ap.add_argument("--ctx", type=int, default=768)
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    ap.add_argument("--rot", type=int, default=16)
    ap.add_argument("--tiny", action="store_true",
                    help="CPU, under TRITON_INTERPRET=1: small shapes, fp16, nothing timed")
    args = ap.parse_args()
    if args.tiny:
        dev, dt, timer = torch.device("cpu"), torch.float16, _untimed
        heads, kvh, d, page = 8, 2, 32, 16
        args.ctx, args.splits, args.rot = 40, [1, 3], 2
    else:
        dev, dt, timer = torch.device("cuda"), torch.bfloat16, time_graph
        heads, kvh, d, page = 32, 8, 128, 16
    pages = -(-args.ctx // page)
    cos_sin = torch.randn(args.ctx + 1, d, device=dev, dtype=torch.float32)
    caches = [(torch.randn(pages, page, kvh, d, device=dev, dtype=dt),
               torch.randn(pages, page, kvh, d, device=dev, dtype=dt)) for _ in range(args.rot)]
    pdl.set_enabled(True)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)"
    results: dict = {"device": name, "ctx": args.ctx, "rows": {}, "bitwise": {}}
    for q_len in (1, 4):
        row, bitwise = probe_row(q_len, args, caches, cos_sin, heads, timer)
        results["rows"][q_len], results["bitwise"][q_len] = row, bitwise
        print("q_len", q_len, json.dumps(row), "bitwise", json.dumps(bitwise), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attn_chain_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
