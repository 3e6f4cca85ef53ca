"""GPU kernel benchmark: the Triton GEMV against torch (cuBLAS) at the decode shapes of a
Llama-3.1-8B-shaped model, its EAGLE-3 head and SmolLM2-135M, and the fused rotary + paged
KV write against the separate kernels. Needs CUDA; finishes in about two minutes on an H200.

    PYTHONPATH=src python scripts/gpu_kernel_bench.py --out $OUT/gpu_kernels

Parts, in order (a deadline skips what is left and says so):
1. start-up selection (GemvSelector) on the 8B target's shapes in bf16, cold (compilation
   included), then the weights-only GEMM chain of one decode step (32 layers + lm_head,
   distinct weights, one CUDA graph) through torch and through the selected plan;
2. every start-up candidate per (shape, dtype, M in 1/2/4/8): max abs / rel error against
   torch and against an fp32 product, device time in CUDA graphs over weights exceeding the
   L2 cache, achieved GB/s (weight bytes / time);
3. fused rotary + KV write against rotary + KV write at batch 1 and 64.
Writes kernels.json and kernels.md to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.layers import triton_ops
from specserve.layers.attention import triton_kernels
from specserve.layers.gemv import candidate_configs, gemv
from specserve.layers.gemv_select import GemvSelector, rotation_set, time_in_graph_us
from specserve.layers.rotary import RotaryEmbedding

SHAPES = {  # name -> (N, K)
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    "lm_head": (128256, 4096), "eagle_fc": (4096, 12288),
    "smol_qkv": (960, 576), "smol_o": (576, 576), "smol_gate_up": (3072, 576),
    "smol_down": (576, 1536), "smol_lm_head": (49152, 576),
}  # fmt: skip
TARGET = ("qkv", "o", "gate_up", "down")  # per layer of the 8B model, then lm_head
ROWS = (1, 2, 4, 8)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
REL_TOL = {"bf16": 2e-2, "fp16": 4e-3}  # max |triton - torch| / max |torch|


def randn(*shape, dtype):
    return torch.empty(shape, device="cuda", dtype=dtype).normal_(0, shape[-1] ** -0.5)


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (out.float() - ref.float()).abs().max().item()
    return diff, diff / max(ref.float().abs().max().item(), 1e-30)


@torch.inference_mode()
def selection_and_chain(layers: int, reps: int) -> dict:
    """Part 1: cold start-up selection over the 8B target's weights, then the GEMM chain."""
    dt = torch.bfloat16
    weights = {name: [randn(*SHAPES[name], dtype=dt) for _ in range(layers)] for name in TARGET}
    weights["lm_head"] = [randn(*SHAPES["lm_head"], dtype=dt)]
    groups = {(ws[0].shape[0], ws[0].shape[1], dt): ws for ws in weights.values()}
    selector = GemvSelector(budget_s=5.0)
    start = time.perf_counter()
    plan = selector.select(groups)
    out = dict(selection_s=round(time.perf_counter() - start, 2), skipped=selector.skipped,
               plan=plan.summary(), chain_ms={})  # fmt: skip
    for m in ROWS:
        xs = {n: randn(m, SHAPES[n][1], dtype=dt) for n in (*TARGET, "lm_head")}
        for label, linear in (("torch", F.linear), ("plan", plan.linear)):

            def chain(x, _w, linear=linear, xs=xs):
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
    return out


@torch.inference_mode()
def gemv_sweep(deadline: float, reps: int) -> tuple[list[dict], list[str]]:
    """Part 2: every candidate at every shape, dtype and M."""
    rows_out, skipped = [], []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    min_bytes = 4 * getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    for shape, (n, k) in SHAPES.items():  # the 8B shapes first, in both dtypes
        for dname, dt in DTYPES.items():
            rotation = rotation_set([randn(n, k, dtype=dt)], min_bytes)
            weight_bytes = n * k * rotation[0].element_size()
            for m in ROWS:
                if time.perf_counter() > deadline:
                    skipped.append(f"{shape}-{dname}-m{m}")
                    continue
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


@torch.inference_mode()
def rotary_kv_case(dt, batch: int, rope, reps: int, layers: int) -> dict:
    """The 8B attention shape, page size 16: rotary kernel + KV write kernel against the fused
    kernel, each `layers` times in one CUDA graph; outputs compared bit for bit."""
    q_heads, kv_heads, d, page = 32, 8, 128, 16
    qkv = randn(batch, (q_heads + 2 * kv_heads) * d, dtype=dt)
    pos = torch.randint(0, rope.max_positions, (batch,), device="cuda")
    slots = torch.randperm(4096 * page, device="cuda")[:batch] + page
    caches = [randn(4097, page, kv_heads, d, dtype=dt) for _ in range(2)]
    caches += [c.clone() for c in caches]
    q, k, v = qkv.split([q_heads * d, kv_heads * d, kv_heads * d], -1)
    q, k, v = (t.reshape(batch, -1, d) for t in (q, k, v))

    def unfused(_x, _w):
        qr, kr = triton_ops.rotary(pos, q, k, rope.cos_sin)
        triton_kernels.write_kv(kr, v, caches[0], caches[1], slots)
        return qr

    def fused(_x, _w):
        return triton_ops.rotary_store_kv(pos, qkv, rope.cos_sin, q_heads, kv_heads, caches[2],
                                          caches[3], slots)  # fmt: skip

    q_a, q_b = unfused(None, None), fused(None, None)
    torch.cuda.synchronize()
    same = (torch.equal(q_a, q_b) and torch.equal(caches[0], caches[2])
            and torch.equal(caches[1], caches[3]))  # fmt: skip
    us = {name: time_in_graph_us(fn, None, [None] * layers, reps)
          for name, fn in (("unfused", unfused), ("fused", fused))}  # fmt: skip
    return dict(batch=batch, unfused_us=round(us["unfused"], 2), fused_us=round(us["fused"], 2),
                identical=same, per_step_saving_us=round(layers * (us["unfused"] - us["fused"]), 1))


def rotary_kv_bench(reps: int, layers: int = 32) -> list[dict]:
    """Part 3, batch 1 and 64 in both dtypes."""
    rope = RotaryEmbedding(128, 500000.0, 8192)
    rope.materialize(torch.device("cuda"))
    return [dict(dtype=dname, **rotary_kv_case(dt, batch, rope, reps, layers))
            for dname, dt in DTYPES.items() for batch in (1, 64)]  # fmt: skip


def markdown(result: dict) -> str:
    lines = [f"# GPU kernels: {result['device']}", "", f"Command: `{result['command']}`", ""]
    sel = result.get("selection")
    if sel:
        lines += [f"Start-up selection over the 8B target's shapes (bf16, cold): "
                  f"{sel['selection_s']} s, {sel['skipped']} candidates past the budget.", "",
                  "| weights-only GEMM chain, ms (M) | torch | plan |",
                  "|---|---|---|"]  # fmt: skip
        for m in ROWS:
            c = sel["chain_ms"]
            lines.append(f"| M={m} ({sel['chain_weight_gb']} GB) | {c[f'torch-m{m}']} | "
                         f"{c[f'plan-m{m}']} |")  # fmt: skip
        lines.append("")
    lines += ["| shape (N x K) | dtype | M | torch us | torch GB/s | best Triton | us | GB/s | "
              "x torch | max rel err vs torch | all candidates ok |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["gemv"]:
        best = next(c for c in r["candidates"] if c["config"] == r["best"])
        lines.append(f"| {r['shape']} ({r['n']}x{r['k']}) | {r['dtype']} | {r['m']} | "
                     f"{r['torch_us']} | {r['torch_gbps']} | {r['best']} | {r['best_us']} | "
                     f"{r['best_gbps']} | {r['speedup']} | {best['max_rel_vs_torch']:.2e} | "
                     f"{r['all_ok']} |")  # fmt: skip
    lines += ["", "| rotary + KV write | batch | unfused us | fused us | identical | "
              "saving per 32-layer step, us |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["rotary_kv"]:
        lines.append(f"| {r['dtype']} | {r['batch']} | {r['unfused_us']} | {r['fused_us']} | "
                     f"{r['identical']} | {r['per_step_saving_us']} |")  # fmt: skip
    if result["skipped"]:
        lines += ["", f"Skipped past the deadline: {', '.join(result['skipped'])}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="deadline for the candidate sweep, from the start")
    ap.add_argument("--reps", type=int, default=7, help="graph replays per timing (median)")
    ap.add_argument("--layers", type=int, default=32, help="layers of the GEMM chain")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    start = time.perf_counter()
    deadline = start + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    result = dict(device=props.name, torch=torch.__version__, command=(
        "PYTHONPATH=src python scripts/gpu_kernel_bench.py --out OUT"), skipped=[])
    import triton

    result["triton"] = triton.__version__
    result["selection"] = selection_and_chain(args.layers, args.reps)
    torch.cuda.empty_cache()
    print(json.dumps({k: v for k, v in result["selection"].items() if k != "plan"}), flush=True)
    result["gemv"], result["skipped"] = gemv_sweep(deadline - 20, args.reps)
    result["rotary_kv"] = rotary_kv_bench(args.reps)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    result["all_ok"] = all(r["all_ok"] for r in result["gemv"])
    result["median_speedup"] = statistics.median(r["speedup"] for r in result["gemv"])
    (args.out / "kernels.json").write_text(json.dumps(result, indent=1))
    (args.out / "kernels.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
