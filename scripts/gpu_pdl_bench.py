"""GPU A/B of programmatic dependent launch and the kernel fusions (issue 5's batch-1
target): plain decode of a random Llama-3.1-8B-shaped bf16 model at batch 1 and 64 under
six engines built from one model, side by side in one process:

- "pdl+fusion": the defaults;
- "pdl, split-K fusion only": the defaults less the SiLU prologue (a separate SiLU-and-mul
  kernel again; the down GEMV's split-K pass still fused into the next RMSNorm), to tell
  the two fusions apart (the prologue recomputes SiLU in every program of the GEMV);
- "pdl+fusion, no L2 prefetch": the defaults, but the GEMV waits for the previous kernel
  without asking L2 for its first weight lines (gemv.PDL_PREFETCH_BYTES = 0), to see what
  the prefetch adds to the launch overlap;
- "pdl only": --disable-fusion (SiLU-and-mul and the split-K pass as kernels of their own);
- "fusion only": --disable-pdl;
- "neither": both disabled (the kernels of run 6 in docs/benchmarks/gpu_engine.md).

All engines are built first (they share the weights and the GEMV plan, and each has
its own CUDA graphs, captured under its own settings), then timed in interleaved rounds
(every engine once per round, `--rounds` rounds) so that drift on a shared machine spreads
evenly; each cell is the median over rounds. 512-token prompts, 256 new tokens (greedy,
ignore_eos), prefill not timed (gpu_engine_bench.run). Writes JSON and a markdown table.

    PYTHONPATH=src python scripts/gpu_pdl_bench.py --out $OUT/gpu_pdl
    PYTHONPATH=src python scripts/gpu_pdl_bench.py --tiny --out /tmp/gpu_pdl   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine_bench import LLAMA_8B, random_model, run  # noqa: E402

from specserve.config import EngineConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.layers import pdl  # noqa: E402

CONFIGS = {
    "pdl+fusion": {},
    "pdl, split-K fusion only": {"silu_prologue": False},
    "pdl+fusion, no L2 prefetch": {"prefetch": False},
    "pdl only": {"disable_fusion": True},
    "fusion only": {"disable_pdl": True},
    "neither": {"disable_pdl": True, "disable_fusion": True},
}
BASELINE = "neither"


@contextmanager
def without_silu_prologue():
    """Engines built meanwhile fuse the split-K pass but keep SiLU-and-mul a kernel of its
    own, neither the down projection's prologue nor the gate/up epilogue (a benchmark-only
    setting: the engine's one switch sets every fusion)."""
    from specserve.layers import triton_ops

    original = triton_ops.use_triton_ops

    def use_triton_ops(model, enable=True, fuse=True):
        changed = original(model, enable, fuse)
        for module in model.modules():
            if isinstance(module, triton_ops.TritonMergedGatedMLP):
                module.fuse_silu = module.fuse_gate = False
        return changed

    triton_ops.use_triton_ops = use_triton_ops  # the engine imports it at start-up
    try:
        yield
    finally:
        triton_ops.use_triton_ops = original


def down_proj_kernels(model, batches: list[int]) -> dict:
    """What serves the down projection per batch (fusion needs a Triton GEMV; the split-K
    pass fusion also a K split), from the installed GEMV plan."""
    down = model.model.layers[0].mlp.down_proj
    plan = getattr(down, "gemv_plan", None)
    out = {}
    for b in batches:
        cfg = plan.config_for(b, *down.weight.shape, down.weight.dtype) if plan else None
        out[b] = str(cfg) if cfg else "torch"
    return out


@contextmanager
def without_l2_prefetch():
    """GEMVs launched meanwhile (this engine's graphs) prefetch no weight lines."""
    from specserve.layers import gemv

    original, gemv.PDL_PREFETCH_BYTES = gemv.PDL_PREFETCH_BYTES, 0
    try:
        yield
    finally:
        gemv.PDL_PREFETCH_BYTES = original


def build(model, base: dict, extra: dict, batches: list[int]) -> tuple[LLMEngine, dict]:
    t0 = time.perf_counter()
    extra = dict(extra)
    silu_prologue, prefetch = extra.pop("silu_prologue", True), extra.pop("prefetch", True)
    with ExitStack() as patches:
        if not silu_prologue:
            patches.enter_context(without_silu_prologue())
        if not prefetch:
            patches.enter_context(without_l2_prefetch())
        engine = LLMEngine(EngineConfig(**base, **extra), model=model)
    device = next(model.parameters()).device
    mlp = model.model.layers[0].mlp
    info = {
        "startup_s": round(time.perf_counter() - t0, 2),
        "pdl_active": pdl.active(device),  # as set for this engine's capture
        "fusions": {k: getattr(mlp, k, False) for k in ("fuse_silu", "fuse_split_k", "fuse_gate")},
        "down_proj": down_proj_kernels(model, batches),
        "graphs": engine.runner.graphs.report.__dict__ if engine.runner.graphs else None,
    }
    return engine, info


def table(results: dict, batches: list[int]) -> list[str]:
    base = {b: results[BASELINE]["median"][b] for b in batches}
    head = " | ".join(f"batch {b} tok/s (x {BASELINE}) | batch {b} ms/step" for b in batches)
    lines = [f"| config | {head} |", "|---|" + "---|---|" * len(batches)]
    for name, res in results.items():
        cells = []
        for b in batches:
            med = res["median"][b]
            ratio = med["output_tok_s"] / base[b]["output_tok_s"]
            cells += [f"{med['output_tok_s']} ({ratio:.3f}x)", f"{med['ms_per_step']}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_pdl")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                    help=f"engines to compare (the table's ratios need {BASELINE!r})")
    ap.add_argument("--tiny", action="store_true", help="a small shape on the CPU (smoke test)")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        args.prompt_len, args.new_tokens = min(args.prompt_len, 32), min(args.new_tokens, 8)
        args.rounds = min(args.rounds, 2)
    tiny = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                head_dim=16, num_layers=4)  # fmt: skip
    model = random_model(replace(LLAMA_8B, **tiny) if args.tiny else LLAMA_8B, device)
    tokens = max(args.batches) * (args.prompt_len + args.new_tokens + 32)
    base = dict(device=device, dtype="bfloat16", max_num_seqs=max(args.batches),
                cuda_graph_max_batch=max(args.batches), speculative_algorithm="none",
                num_kv_pages=tokens // 16 + 8, max_num_batched_tokens=4096,
                max_model_len=args.prompt_len + args.new_tokens + 64)  # fmt: skip
    engines, results = {}, {}
    for name in dict.fromkeys([*args.configs, BASELINE]):
        extra = CONFIGS[name]
        engines[name], results[name] = build(model, base, extra, args.batches)
        for b in args.batches:  # warm-up: first-use costs of every shape, not timed
            run(engines[name], b, args.prompt_len, min(24, args.new_tokens))
        results[name]["rounds"] = {b: [] for b in args.batches}
        print(name, json.dumps(results[name]), flush=True)
    for r in range(args.rounds):
        for name, engine in engines.items():  # interleaved: drift hits every config alike
            for b in args.batches:
                row = run(engine, b, args.prompt_len, args.new_tokens)
                results[name]["rounds"][b].append(row)
                print(f"round {r} {name} batch {b}: {row['output_tok_s']} tok/s, "
                      f"{row['ms_per_step']} ms/step", flush=True)  # fmt: skip
    for res in results.values():
        res["median"] = {
            b: {key: round(statistics.median(row[key] for row in rows), digits)
                for key, digits in (("output_tok_s", 1), ("ms_per_step", 3))}
            for b, rows in res["rounds"].items()
        }  # fmt: skip
    lines = table(results, args.batches)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "args": vars(args)}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
