"""Why a host-paced engine runs slower than another of the same configuration (GPU).

On the default model (SmolLM2-135M) steps take ~1-2 ms and the host paces them, and the
same configuration built twice in one process has read up to 30% apart
(gpu_default_model.md). This builds engines on a random SmolLM2-shaped bf16 model (hidden
576, 30 layers, 9/3 heads, vocabulary 49152) and a random EAGLE-3 head, in the bench's
order and then plain and fixed K=3 once more, and records per decode step: wall time, the
main thread's CPU time, the process's CPU time (all threads), the CPU the main thread ran
on, the device span and idle gap (the step loop's CUDA events), and the threads alive; GPU
clocks before and after each run. If a slow engine spends more CPU time per step, the host
does more work or runs slower per instruction; if only its wall time grows, it waits
(another thread, the OS, the driver).

    PYTHONPATH=src python scripts/diag_host_pace.py --out $OUT/host_pace
    PYTHONPATH=src python scripts/diag_host_pace.py --cpu --new-tokens 8 --out /tmp/hp  # smoke
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine_bench import LLAMA_8B, random_head, random_model  # noqa: E402

from specserve.config import EngineConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.runtime import graph_staging, packing  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402

SMOLLM2 = replace(LLAMA_8B, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                  rope_theta=100000.0, tie_word_embeddings=True)  # fmt: skip


def current_cpu() -> int:
    """The CPU the calling (main) thread last ran on (/proc: field 39 of its stat)."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except OSError:
        return -1


def steal_and_mhz() -> tuple[int, float]:
    """The machine's CPU steal time so far (all CPUs, in clock ticks: time a hypervisor ran
    something else while this VM's CPUs wanted to run) and the mean CPU MHz now."""
    try:
        with open("/proc/stat") as f:
            steal = int(f.readline().split()[8])
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
        return steal, round(sum(mhz) / max(1, len(mhz)), 1)
    except (OSError, IndexError, ValueError):
        return -1, -1.0


def clocks() -> str | None:
    """SM and memory clocks, power and temperature now (nvidia-smi), None without it."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=10)  # fmt: skip
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4) if xs else 0.0


def run(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in torch.randint(0, 32000, (batch, prompt_len), generator=gen).tolist():
        engine.add_request(p, params)
    while any(r.cached_len < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    engine.loop.drain()
    engine.loop.times.clear()
    before, steal0 = clocks(), steal_and_mhz()
    wall, thread_cpu, proc_cpu, cpus = [], [], [], {}
    produced = sum(len(r.output_token_ids) for r in engine.requests.values())
    trace = engine.spec.policy.trace if engine.spec is not None else None
    decisions0 = trace.num_decisions if trace is not None else 0
    while engine.has_unfinished():
        w, c, p = time.perf_counter(), time.thread_time(), time.process_time()
        engine.step()
        wall.append((time.perf_counter() - w) * 1e3)
        thread_cpu.append((time.thread_time() - c) * 1e3)
        proc_cpu.append((time.process_time() - p) * 1e3)
        cpu = current_cpu()
        cpus[cpu] = cpus.get(cpu, 0) + 1
    seconds = sum(wall) / 1e3  # the steps alone (this loop's own sampling left out)
    steal1 = steal_and_mhz()
    times = engine.loop.times
    ks = []  # each decode step's K (the policy's decisions of this run, in order)
    if trace is not None:
        decisions = trace.dump()
        ks = [
            d["k"] for d in decisions[max(0, len(decisions) - (trace.num_decisions - decisions0)) :]
        ]
    # steady K=3 steps (the step before ran K=3 too): their median wall and CPU time
    steady = [i for i in range(1, min(len(ks), len(wall))) if ks[i] == ks[i - 1] == 3]
    return {
        "tok_s": round((batch * new_tokens - produced) / seconds, 1),
        "steps": len(wall),
        "wall_ms_p50": med(wall),
        "wall_ms_mean": round(sum(wall) / max(1, len(wall)), 4),
        "thread_cpu_ms_p50": med(thread_cpu),
        "process_cpu_ms_p50": med(proc_cpu),
        "device_span_ms_p50": med(times.step_ms),
        "gap_ms_p50": med(times.gap_ms),
        "host_wait_ms_p50": med(times.wait_ms),
        "steady_k3_steps": len(steady),
        "steady_k3_wall_ms_p50": med([wall[i] for i in steady]),
        "steady_k3_cpu_ms_p50": med([thread_cpu[i] for i in steady]),
        "ks": ks,
        "wall_ms": [round(w, 3) for w in wall],
        "cpus": dict(sorted(cpus.items(), key=lambda kv: -kv[1])[:4]),
        "threads": sorted(t.name for t in threading.enumerate()),
        "clocks_before_after": [before, clocks()],
        # CPU steal ticks during the run (all CPUs), mean CPU MHz before and after
        "steal_ticks": steal1[0] - steal0[0],
        "cpu_mhz_before_after": [steal0[1], steal1[1]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="a smoke test on the CPU")
    ap.add_argument(
        "--fixed-only",
        type=int,
        default=0,
        help="build this many fixed K=3 engines instead of the bench's order",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="one more run per engine under cProfile: its top functions",
    )
    ap.add_argument(
        "--acceptance",
        type=float,
        default=2.5,
        help="simulated mean acceptance length at K=3 (0: the random head's own, about none: "
        "the greedy verification inside the verify graphs, as on the default model)",
    )
    ap.add_argument("--only", nargs="+", default=None, help="configurations by name")
    ap.add_argument(
        "--ab-host",
        action="store_true",
        help="each configuration twice in a row, the second with a shifted step's positions "
        "moved through torch operations as before session 16 (packing.SHIFT_KERNEL False)",
    )
    ap.add_argument(
        "--ab-stage",
        action="store_true",
        help="each configuration twice in a row, the second with the step copied into the "
        "graphs' static buffers through torch operations as before session 17 "
        "(graph_staging.STAGE_KERNEL False)",
    )
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    shape = replace(SMOLLM2, num_layers=8) if args.cpu else SMOLLM2
    model = random_model(shape, device)
    head = random_head(shape, Path(tempfile.mkdtemp()) / "head")
    base = dict(device=device, dtype="bfloat16", max_num_seqs=max(16, args.batch),
                cuda_graph_max_batch=max(16, args.batch), kv_cache_bytes=2**30,
                max_num_batched_tokens=4096, max_model_len=4096)  # fmt: skip
    # mean acceptance length 2.5 at K=3: about the shipped head's real rate (~0.7 a draft)
    spec = dict(speculative_algorithm="eagle3", speculative_draft_model_path=str(head),
                speculative_num_steps=3)  # fmt: skip
    if args.acceptance:
        spec["speculative_simulate_acceptance"] = args.acceptance
    configs = [
        ("plain", {"speculative_algorithm": "none"}),
        ("eagle3 K=3 fixed", {**spec, "speculative_policy": "fixed"}),
        ("eagle3 goodput", {**spec, "speculative_policy": "goodput"}),
        ("eagle3 policy off", {**spec, "speculative_policy": "off"}),
        ("plain (again)", {"speculative_algorithm": "none"}),
        ("eagle3 K=3 fixed (again)", {**spec, "speculative_policy": "fixed"}),
    ]
    if args.fixed_only:
        configs = [(f"eagle3 K=3 fixed #{i}", configs[1][1]) for i in range(args.fixed_only)]
    if args.only:
        configs = [(name, extra) for name, extra in configs if name in args.only]
    if args.ab_host:
        configs = [c for name, extra in configs
                   for c in ((name, extra), (f"{name} (host baseline)", extra))]  # fmt: skip
    if args.ab_stage:
        configs = [c for name, extra in configs
                   for c in ((name, extra), (f"{name} (torch staging)", extra))]  # fmt: skip
    results, profiles = {}, {}
    for name, extra in configs:
        packing.SHIFT_KERNEL = "(host baseline)" not in name
        graph_staging.STAGE_KERNEL = "(torch staging)" not in name
        engine = LLMEngine(EngineConfig(**base, **extra), model=model)
        run(engine, args.batch, args.prompt_len, 16, seed=99)  # warm-up: first-use compiles
        gc.collect()
        gc.freeze()
        results[name] = [run(engine, args.batch, args.prompt_len, args.new_tokens, seed)
                         for seed in range(args.repeats)]  # fmt: skip
        shown = (
            "tok_s",
            "steps",
            "wall_ms_p50",
            "thread_cpu_ms_p50",
            "device_span_ms_p50",
            "steady_k3_steps",
            "steady_k3_wall_ms_p50",
            "steady_k3_cpu_ms_p50",
        )
        print(name, json.dumps([{k: r[k] for k in shown} for r in results[name]]), flush=True)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            run(engine, args.batch, args.prompt_len, args.new_tokens, seed=7)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
            profiles[name] = text.getvalue()
            print(profiles[name][-7000:], flush=True)
        gc.unfreeze()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results["args"] = {k: str(v) for k, v in vars(args).items()}  # what was run
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    if profiles:
        args.out.with_suffix(".profiles.txt").write_text(
            "\n".join(f"== {k}\n{v}" for k, v in profiles.items())
        )


if __name__ == "__main__":
    main()
