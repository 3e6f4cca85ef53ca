"""GPU kernel benchmark: the Triton GEMV / skinny GEMM against torch (cuBLAS) at the decode
shapes (M = 1..64 rows) of a Llama-3.1-8B-shaped model, its EAGLE-3 head and SmolLM2-135M;
the fused rotary + paged KV write; the paged attention kernels at decode and verify shapes.
Needs CUDA; about three minutes on an H200 (each part has a deadline, skips what is left and
says so; results are rewritten after every part).

    PYTHONPATH=src:scripts python scripts/gpu_kernel_bench.py --out $OUT/gpu_kernels

Parts, in order:
1. start-up selection (GemvSelector, cold Triton cache unless --warm-cache) on the 8B
   target's shapes in bf16 with the parallel compile, on SmolLM2's, and on the 8B's in fp16
   with one compile thread (fp16 variants are cold too: the parallel compile's effect);
   compile / total seconds, untried candidates, the plan; then the weights-only GEMM chain
   of one decode step (32 layers + lm_head, distinct weights, one CUDA graph) through torch
   and through the bf16 plan at M = 1..64;
2. every start-up candidate per (shape, M in 1/2/4/8/16/32/64), bf16: max abs / rel error
   against torch and an fp32 product, device time in CUDA graphs over weights exceeding the
   L2 cache, achieved GB/s (weight bytes / time);
3. fused rotary + KV write against rotary + KV write at batch 1 and 64 (rotary_kv_bench.py);
4. attention (attn_kernel_bench.py): generic vs decode kernel, configs x split counts.
Writes kernels.json and kernels.md to --out.
"""

from __future__ import annotations

import os
import sys
import tempfile

if __name__ == "__main__" and "--warm-cache" not in sys.argv:  # before triton is imported
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attn_kernel_bench import attention_bench  # noqa: E402
from attn_kernel_bench import markdown as attention_markdown  # noqa: E402
from rotary_kv_bench import markdown as rotary_kv_markdown  # noqa: E402
from rotary_kv_bench import rotary_kv_bench  # noqa: E402

from specserve.layers.gemv import candidate_configs, gemv  # noqa: E402
from specserve.layers.gemv_select import (  # noqa: E402
    ROW_BUCKETS,
    GemvSelector,
    rotation_set,
    time_in_graph_us,
)

SHAPES = {  # name -> (N, K)
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    "lm_head": (128256, 4096), "eagle_fc": (4096, 12288), "eagle_qkv": (6144, 8192),
    "smol_qkv": (960, 576), "smol_o": (576, 576), "smol_gate_up": (3072, 576),
    "smol_down": (576, 1536), "smol_lm_head": (49152, 576),
}  # fmt: skip
TARGET = ("qkv", "o", "gate_up", "down")  # per layer of the 8B model, then lm_head
SMOL = ("smol_qkv", "smol_o", "smol_gate_up", "smol_down")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
REL_TOL = {"bf16": 2e-2, "fp16": 4e-3}  # max |triton - torch| / max |torch|


def randn(*shape, dtype):
    return torch.empty(shape, device="cuda", dtype=dtype).normal_(0, shape[-1] ** -0.5)


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (out.float() - ref.float()).abs().max().item()
    return diff, diff / max(ref.float().abs().max().item(), 1e-30)


def select(names, layers: int, lm_head: str, dt, workers: int | None = None):
    weights = {name: [randn(*SHAPES[name], dtype=dt) for _ in range(layers)] for name in names}
    weights[lm_head] = [randn(*SHAPES[lm_head], dtype=dt)]
    groups = {(ws[0].shape[0], ws[0].shape[1], dt): ws for ws in weights.values()}
    selector = GemvSelector(compile_workers=workers)
    start = time.perf_counter()
    plan = selector.select(groups)
    info = dict(selection_s=round(time.perf_counter() - start, 2),
                compile_s=round(selector.compile_s, 2), variants=selector.compiled,
                workers=selector.compile_workers, skipped=selector.skipped,
                triton_wins=sum(r["kernel"] != "torch" for r in plan.summary()),
                keys=len(plan.choices), plan=plan.summary())  # fmt: skip
    return info, plan, weights


@torch.inference_mode()
def selection_and_chain(layers: int, reps: int, deadline: float) -> dict:
    """Part 1: cold start-up selections, then the 8B GEMM chain through the bf16 plan."""
    out: dict = {}
    out["8b_bf16"], plan, weights = select(TARGET, layers, "lm_head", torch.bfloat16)
    print(json.dumps({k: v for k, v in out["8b_bf16"].items() if k != "plan"}), flush=True)
    out["chain_ms"] = {}
    for m in ROW_BUCKETS:
        xs = {n: randn(m, SHAPES[n][1], dtype=torch.bfloat16) for n in (*TARGET, "lm_head")}
        for label, linear in (("torch", F.linear), ("plan", plan.linear)):

            def chain(x, _w, linear=linear, xs=xs, weights=weights):
                for i in range(layers):
                    for name in TARGET:
                        linear(xs[name], weights[name][i])
                linear(xs["lm_head"], weights["lm_head"][0])

            chain(None, None)
            torch.cuda.synchronize()
            us = time_in_graph_us(chain, None, [None], reps)
            out["chain_ms"][f"{label}-m{m}"] = round(us / 1000, 3)
    total = sum(w.numel() * w.element_size() for ws in weights.values() for w in ws)
    out["chain_weight_gb"] = round(total / 1e9, 2)
    del weights, plan
    torch.cuda.empty_cache()
    out["smol_bf16"] = select(SMOL, 30, "smol_lm_head", torch.bfloat16)[0]
    torch.cuda.empty_cache()
    if time.perf_counter() < deadline:  # the same shapes, fp16: cold again, one thread
        out["8b_fp16_one_thread"] = select(TARGET, layers, "lm_head", torch.float16, 1)[0]
        torch.cuda.empty_cache()
    return out


@torch.inference_mode()
def gemv_sweep(deadline: float, reps: int, dtypes=("bf16",)) -> tuple[list[dict], list[str]]:
    """Part 2: every candidate at every shape and M."""
    rows_out, skipped = [], []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    min_bytes = 4 * getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    for shape, (n, k) in SHAPES.items():
        for dname in dtypes:
            dt = DTYPES[dname]
            if time.perf_counter() > deadline:
                skipped.append(f"{shape}-{dname}")
                continue
            rotation = rotation_set([randn(n, k, dtype=dt)], min_bytes)
            weight_bytes = n * k * rotation[0].element_size()
            for m in ROW_BUCKETS:
                x = randn(m, k, dtype=dt)
                ref = F.linear(x, rotation[0])
                ref32 = F.linear(x.float(), rotation[0].float())
                torch_us = time_in_graph_us(F.linear, x, rotation, reps)
                row = dict(shape=shape, n=n, k=k, dtype=dname, m=m, torch_us=round(torch_us, 2),
                           torch_gbps=round(weight_bytes / torch_us / 1e3, 1),
                           torch_err_fp32=errors(ref, ref32)[0], candidates=[])  # fmt: skip
                for cfg in candidate_configs(m, n, k, sms):
                    t0 = time.perf_counter()
                    out = gemv(x, rotation[0], None, cfg)  # compiles on first use
                    torch.cuda.synchronize()
                    compile_s = time.perf_counter() - t0
                    abs_err, rel = errors(out, ref)
                    us = time_in_graph_us(lambda x, w, c=cfg: gemv(x, w, None, c), x, rotation,
                                          reps)  # fmt: skip
                    row["candidates"].append(dict(
                        config=str(cfg), us=round(us, 2), gbps=round(weight_bytes / us / 1e3, 1),
                        max_abs_vs_torch=abs_err, max_rel_vs_torch=rel,
                        max_abs_vs_fp32=errors(out, ref32)[0], ok=rel < REL_TOL[dname],
                        first_call_s=round(compile_s, 3)))  # fmt: skip
                best = min(row["candidates"], key=lambda c: c["us"])
                row.update(best=best["config"], best_us=best["us"], best_gbps=best["gbps"],
                           speedup=round(torch_us / best["us"], 3),
                           all_ok=all(c["ok"] for c in row["candidates"]))  # fmt: skip
                rows_out.append(row)
            del rotation
            torch.cuda.empty_cache()
    return rows_out, skipped


def selection_markdown(sel: dict) -> list[str]:
    lines = ["| selection (cold cache) | variants | compile threads | compile s | total s | "
             "untried | Triton wins / keys |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in ("8b_bf16", "smol_bf16", "8b_fp16_one_thread"):
        s = sel.get(name)
        if s:
            lines.append(f"| {name} | {s['variants']} | {s['workers']} | {s['compile_s']} | "
                         f"{s['selection_s']} | {s['skipped']} | {s['triton_wins']} / "
                         f"{s['keys']} |")  # fmt: skip
    lines += ["", "| weights-only GEMM chain, ms (M) | torch | plan |", "|---|---|---|"]
    for m in ROW_BUCKETS:
        c = sel["chain_ms"]
        lines.append(f"| M={m} ({sel['chain_weight_gb']} GB) | {c[f'torch-m{m}']} | "
                     f"{c[f'plan-m{m}']} |")  # fmt: skip
    return lines + [""]


def markdown(result: dict) -> str:
    lines = [f"# GPU kernels: {result['device']}", "", f"Command: `{result['command']}`", ""]
    if "selection" in result:
        lines += selection_markdown(result["selection"])
    if result.get("gemv"):
        lines += ["| shape (N x K) | dtype | M | torch us | torch GB/s | best Triton | us | "
                  "GB/s | x torch | max rel err vs torch | all candidates ok |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in result["gemv"]:
            best = next(c for c in r["candidates"] if c["config"] == r["best"])
            lines.append(f"| {r['shape']} ({r['n']}x{r['k']}) | {r['dtype']} | {r['m']} | "
                         f"{r['torch_us']} | {r['torch_gbps']} | {r['best']} | {r['best_us']} | "
                         f"{r['best_gbps']} | {r['speedup']} | {best['max_rel_vs_torch']:.2e} | "
                         f"{r['all_ok']} |")  # fmt: skip
    if result.get("rotary_kv"):
        lines += rotary_kv_markdown(result["rotary_kv"])
    if result.get("attention"):
        lines += attention_markdown(result["attention"])
    for part, err in result["errors"].items():
        lines += ["", f"Part {part} failed: {err}"]
    if result["skipped"]:
        lines += ["", f"Skipped past the deadline: {', '.join(result['skipped'])}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--budget-s", type=float, default=180.0, help="deadline for everything")
    ap.add_argument("--reps", type=int, default=7, help="graph replays per timing (median)")
    ap.add_argument("--layers", type=int, default=32, help="layers of the GEMM chain")
    ap.add_argument("--warm-cache", action="store_true", help="keep Triton's cache directory")
    ap.add_argument("--parts", default="selection,gemv,rotary,attention")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    result = dict(device=torch.cuda.get_device_properties(0).name, torch=torch.__version__,
                  triton=triton.__version__, cold_cache=not args.warm_cache, skipped=[],
                  errors={}, command="PYTHONPATH=src:scripts python scripts/gpu_kernel_bench.py "
                  "--out OUT")  # fmt: skip
    parts = args.parts.split(",")
    # deadlines from the start: selection 45 s, GEMV sweep 45 s, attention what is left
    plan = [("selection", 45, lambda d: selection_and_chain(args.layers, args.reps, d)),
            ("gemv", 95, lambda d: gemv_sweep(d, args.reps)),
            ("rotary_kv", 100, lambda d: rotary_kv_bench(args.reps)),
            ("attention", args.budget_s, lambda d: attention_bench(d, args.reps))]  # fmt: skip
    for name, until_s, part in plan:
        if name.split("_")[0] not in parts:
            continue
        try:
            value = part(start + min(until_s, args.budget_s))
            if name == "gemv":
                value, skipped = value
                result["skipped"] += skipped
            result[name] = value
        except Exception:
            result["errors"][name] = traceback.format_exc()[-2000:]
            print(result["errors"][name], flush=True)
        torch.cuda.empty_cache()
        result["wall_s"] = round(time.perf_counter() - start, 1)
        if result.get("gemv"):
            result["all_ok"] = all(r["all_ok"] for r in result["gemv"])
            result["median_speedup"] = statistics.median(r["speedup"] for r in result["gemv"])
        (args.out / "kernels.json").write_text(json.dumps(result, indent=1))
        (args.out / "kernels.md").write_text(markdown(result))
        print(f"[{result['wall_s']} s] {name} done", flush=True)
    print(markdown(result))


if __name__ == "__main__":
    main()
