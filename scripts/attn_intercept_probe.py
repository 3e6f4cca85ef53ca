"""Probe: the fixed cost of a decode attention launch at large batches on the GPU.

At batch 64 the decode kernel reads K/V at ~4.5 TB/s at long contexts but ~3.6-3.8 at the
bench's 512-768 keys (gpu_kernels.md: 37.1 us at 512 keys, 124.8 at 2,048, 477.6 at 8,192,
a line with ~8 us of intercept). This times the engine's decode launch (`DECODE_LAUNCH`,
one split, as the backend chooses at 64 requests) over a range of contexts at several
batch sizes, with PDL on and off, each call over its own scattered pages (the rotation of
attn_kernel_bench.py, which overflows L2), and fits us = intercept + ctx * slope per
(batch, PDL): the intercept is what a launch costs whatever its length (ramp, tail,
launch), the slope its streaming rate. Needs CUDA.

    PYTHONPATH=src python scripts/attn_intercept_probe.py --out $OUT/intercept
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from attn_kernel_bench import HEAD_DIM, KV_HEADS, PAGE, Case

from specserve.layers import pdl
from specserve.layers.attention.triton_attn import DECODE_LAUNCH


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line through (xs, ys): (intercept, slope)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("intercept"))
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--contexts", type=int, nargs="+",
                    default=[32, 128, 256, 512, 640, 768, 1024, 2048])  # fmt: skip
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--launch",
        default=None,
        help="block_n,warps,stages of the decode kernel (default: DECODE_LAUNCH)",
    )
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    min_bytes = 4 * getattr(props, "L2_cache_size", 64 << 20)
    pages = max(args.batches) * -(-max(args.contexts) // PAGE) * 8 + 1
    pool = tuple(torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda",
                             dtype=torch.bfloat16) for _ in "kv")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    cfg = ("decode", DECODE_LAUNCH.block_n, DECODE_LAUNCH.num_warps, DECODE_LAUNCH.num_stages)
    if args.launch:
        cfg = ("decode", *(int(v) for v in args.launch.split(",")))
    rows, fits = [], []
    for use_pdl in (True, False):
        pdl.set_enabled(use_pdl)
        for batch in args.batches:
            xs, ys = [], []
            for ctx in args.contexts:
                case = Case(pool, batch, ctx, 1, min_bytes, gen)
                us = case.time_us(cfg, 1, args.reps)
                rows.append(dict(pdl=use_pdl, batch=batch, ctx=ctx, layers=len(case.tables),
                                 us=round(us, 2),
                                 gbps=round(case.kv_bytes / us / 1e3, 1)))  # fmt: skip
                xs.append(ctx)
                ys.append(us)
                del case
            long = [(x, y) for x, y in zip(xs, ys) if x >= 512]
            if len(long) < 2:  # a line needs two contexts of 512 keys or more
                continue
            intercept, slope = fit([x for x, _ in long], [y for _, y in long])
            bytes_per_key = 2 * batch * KV_HEADS * HEAD_DIM * 2
            fits.append(dict(pdl=use_pdl, batch=batch, programs=batch * KV_HEADS,
                             fit_from_ctx=512, intercept_us=round(intercept, 2),
                             slope_us_per_key=round(slope, 5),
                             stream_tbps=round(bytes_per_key / slope / 1e6, 2)))  # fmt: skip
            print(json.dumps(fits[-1]), flush=True)
    result = dict(device=props.name, sms=props.multi_processor_count, config=list(cfg),
                  splits=1, fits=fits, rows=rows)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if not args.launch else "_" + args.launch.replace(",", "_")
    (args.out / f"attn_intercept_probe{suffix}.json").write_text(json.dumps(result, indent=1))
    lines = ["| PDL | batch | " + " | ".join(f"{c} keys" for c in args.contexts)
             + " | intercept us | stream TB/s |",
             "|---|---|" + "---|" * (len(args.contexts) + 2)]  # fmt: skip
    for f in fits:
        us = [r["us"] for r in rows if r["pdl"] == f["pdl"] and r["batch"] == f["batch"]]
        lines.append(f"| {'on' if f['pdl'] else 'off'} | {f['batch']} | "
                     + " | ".join(str(u) for u in us)
                     + f" | {f['intercept_us']} | {f['stream_tbps']} |")  # fmt: skip
    (args.out / f"attn_intercept_probe{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
