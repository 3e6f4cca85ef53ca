"""Tensor-parallel benchmark of the whole engine: a random-weight model of a preset shape
(`--load-format dummy`), each rank building only its shard, at each tensor-parallel size
asked for, side by side in one run: plain decode at each batch size and EAGLE-3 K=3 at a
simulated acceptance (a random head of the target's shape, whole on every rank or sharded
like the target: `--heads replicated sharded`),
512-token prompts, 256 output tokens (ignore_eos). Per row: decode tok/s, ms per step, and
the share of a decode step spent in collectives on rank 0 (a profile of a few steps: NCCL
kernels over all kernels on GPUs; on CPUs, gloo's collectives over the steps' wall time,
waits for the other ranks included).

    python benchmarks/tp_engine.py --model llama-3.1-8b --tp 1 2 4 8 --out results/tp_8b
    python benchmarks/tp_engine.py --model llama-3.1-70b --tp 4 8 --heads replicated sharded \
        --out results/tp_70b
    NCCL_P2P_DISABLE=1 python benchmarks/tp_engine.py ...   # collectives through host memory
    python benchmarks/tp_engine.py --cpu --model tiny --tp 1 2 --batches 2 --prompt-len 16 \
        --new-tokens 8 --out results/tp_dry   # the dry run: gloo on the CPU, a tiny shape

NVLink multicast stays off in every process specserve starts (`NCCL_NVLS_ENABLE=0` and
friends are set before the ranks spawn). Writes JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from specserve.core.config import EngineConfig
from specserve.core.sampling_params import SamplingParams
from specserve.engine.engine import LLMEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import combine  # noqa: E402
from gpu_engine import run  # noqa: E402

# Multicast (NVLS) off, as the multi-GPU runs require; spawned ranks inherit the environment.
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
TINY = {  # --model tiny: a Llama of 8 layers, heads divisible by 1, 2 and 4 ranks
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
    "dtype": "float32",
}
COLLECTIVES = re.compile(r"nccl|all_?reduce|all_?gather|broadcast", re.IGNORECASE)


def collective_share(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> float | None:
    """The share of `steps` decode steps of `batch` requests spent in collectives on this
    rank (rank 0), from a profile: NCCL kernels over every kernel's device time where CUDA
    runs the model, else gloo's collectives over the steps' wall time. None when nothing
    was recorded."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(7)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for p in torch.randint(0, vocab, (batch, prompt_len), generator=gen).tolist():
        engine.add_request(p, params)
    while any(r.cached_len < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    engine.loop.drain()
    cuda = torch.cuda.is_available() and engine.config.load.device != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        engine.loop.drain()
        if cuda:
            torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) * 1e6
    while engine.has_unfinished():  # the rest of the requests, unprofiled
        engine.step()
    events = prof.key_averages()
    if cuda:
        kernels = [e for e in events if getattr(e, "self_device_time_total", 0) > 0]
        total = sum(e.self_device_time_total for e in kernels)
        ours = sum(e.self_device_time_total for e in kernels if COLLECTIVES.search(e.key))
        return round(ours / total, 4) if total else None
    ours = sum(e.self_cpu_time_total for e in events if COLLECTIVES.search(e.key))
    return round(ours / wall_us, 4) if wall_us and ours else None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="a preset, a config.json, or tiny")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--acceptance", type=float, default=3.0, help="simulated, K=3")
    ap.add_argument(
        "--configs", nargs="+", default=["plain", "k3"], choices=["plain", "k3", "goodput"]
    )
    ap.add_argument(
        "--heads",
        nargs="+",
        default=["replicated"],
        choices=["replicated", "sharded"],
        help="EAGLE-3 head designs to run (--speculative-head-parallel)",
    )
    ap.add_argument("--profile-steps", type=int, default=16, help="0: no collective share")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU, float32 (dry run)")
    ap.add_argument("--out", default="tp_engine")
    args = ap.parse_args(argv)
    os.environ.update({k: os.environ.get(k, v) for k, v in NO_MULTICAST.items()})
    model = args.model
    if model == "tiny":
        folder = Path(tempfile.mkdtemp())
        (folder / "config.json").write_text(json.dumps(TINY))
        model = str(folder / "config.json")
    spec = dict(
        speculative_algorithm="eagle3",
        speculative_num_steps=3,
        speculative_simulate_acceptance=args.acceptance,
    )
    configs = {
        "plain": {"speculative_algorithm": "none"},
        "k3": {**spec, "speculative_policy": "fixed"},
        "goodput": {**spec, "speculative_policy": "goodput"},
    }
    base = dict(
        model=model,
        load_format="dummy",
        device="cpu" if args.cpu else "cuda",
        dtype="float32" if args.cpu else "bfloat16",
        max_num_seqs=max(args.batches),
        cuda_graph_max_batch=max(args.batches),
        max_num_batched_tokens=max(4096, max(args.batches) * 4),
        max_model_len=args.prompt_len + args.new_tokens + 64,
    )
    if args.cpu:
        base["kv_cache_bytes"] = 2**26
    results: dict = {"model": args.model, "env": {k: os.environ.get(k) for k in NO_MULTICAST}}
    results["nccl_p2p_disable"] = os.environ.get("NCCL_P2P_DISABLE")
    rows = results["rows"] = []
    runs = [
        (name, head if name != "plain" else None)
        for name in args.configs
        for head in (args.heads if name != "plain" else [None])
    ]
    for tp in args.tp:
        for name, head in runs:
            extra = dict(configs[name], tensor_parallel_size=tp)
            if head is not None:
                extra["speculative_head_parallel"] = head
                name = f"{name}, head {head}" if len(args.heads) > 1 else name
            t0 = time.perf_counter()
            engine = LLMEngine(EngineConfig.from_flags(**base, **extra))
            startup = time.perf_counter() - t0
            try:
                for b in args.batches:  # warm-up: first-use compiles of each shape
                    run(engine, b, args.prompt_len, 8)
                for b in args.batches:
                    row = combine([run(engine, b, args.prompt_len, args.new_tokens)])
                    share = None
                    if args.profile_steps:
                        share = collective_share(engine, b, args.prompt_len, args.profile_steps)
                    rows.append(
                        {
                            "tp": tp,
                            "config": name,
                            "batch": b,
                            "output_tok_s": row["output_tok_s"],
                            "ms_per_step": row["ms_per_step"],
                            "tokens_per_request_step": row["tokens_per_request_step"],
                            "device_ms_per_step": row["device_ms_per_step"],
                            "collective_share": share,
                            "startup_s": round(startup, 1),
                            "tokens_sha256": row["tokens_sha256"],
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                engine.close()
                del engine
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    lines = markdown(rows)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


def markdown(rows: list[dict]) -> list[str]:
    """One line per (config, batch): tok/s, ms per step and collective share at each TP,
    with the speed-up over the smallest TP run."""
    tps = sorted({r["tp"] for r in rows})
    lines = [
        "| config | batch | " + " | ".join(f"TP={tp} tok/s (ms/step, coll.)" for tp in tps) + " |",
        "|---|---|" + "---|" * len(tps),
    ]
    keys = dict.fromkeys((r["config"], r["batch"]) for r in rows)
    for config, batch in keys:
        at = {r["tp"]: r for r in rows if r["config"] == config and r["batch"] == batch}
        first = at.get(tps[0])
        cells = []
        for tp in tps:
            r = at.get(tp)
            if r is None:
                cells.append("-")
                continue
            ratio = f" {r['output_tok_s'] / first['output_tok_s']:.2f}x" if first else ""
            share = r["collective_share"]
            coll = f", {share:.0%}" if share is not None else ""
            cells.append(f"{r['output_tok_s']}{ratio} ({r['ms_per_step']}{coll})")
        lines.append(f"| {config} | {batch} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    main()
