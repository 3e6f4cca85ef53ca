"""Where a decode step's time goes on the GPU, and what the goodput policy decides.

1. Kernel profile of whole engine steps (torch.profiler, CUDA graph replays included) for
   the 8B shape: plain at batch 1 and 64, and the EAGLE-3 drafter loaded with the policy off
   (K=0 every step) at batch 64; per kernel name: device microseconds per step; plus the
   mean device span and idle gap per step (the step loop's CUDA events).
2. Goodput-policy trace on a SmolLM2-135M-shaped random model (1 ms steps, host-bound) with
   simulated acceptance: every step's decoding requests, chosen K, expected tokens and
   predicted period per K, and the observed periods, next to fixed K=3 and plain.

    PYTHONPATH=src python scripts/diag_profile.py --out $OUT/diag
    PYTHONPATH=src python scripts/diag_profile.py --tiny --out /tmp/diag   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine_bench import LLAMA_8B, random_head, random_model  # noqa: E402

from specserve.config import EngineConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.layers.gemv_select import GemvPlan  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402
from specserve.spec.policy import NO_LOAD  # noqa: E402

SMOLLM2 = replace(
    LLAMA_8B, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True,
)  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
            num_layers=8, vocab_size=1000)  # fmt: skip


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def add(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    vocab = min(engine.model_config.vocab_size, 32000)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in torch.randint(0, vocab, (batch, prompt_len), generator=gen).tolist():
        engine.add_request(p, params)


def drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()
    sync()


def profile(engine: LLMEngine, batch: int, cuda: bool, steps: int = 20) -> dict:
    """Steady decode steps under the profiler: kernel time per step by name."""
    add(engine, batch, 512 if cuda else 16, 200 if cuda else 40)
    while any(r.cached_len < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    for _ in range(10):
        engine.step()
    sync()
    engine.loop.times.clear()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    kernels: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    host: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.name[:90]] += evt.time_range.elapsed_us() / steps
            counts[evt.name[:90]] += 1
        elif evt.name.startswith(("aten::", "cuda")):
            host[evt.name] += evt.time_range.elapsed_us() / steps
    times = engine.loop.times
    drain(engine)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:40]
    return {
        "batch": batch,
        "wall_ms_per_step_profiled": round(wall_ms, 3),
        "device_span_ms": round(sum(times.step_ms) / max(1, len(times.step_ms)), 3),
        "idle_gap_ms": round(sum(times.gap_ms) / max(1, len(times.gap_ms)), 3),
        "kernel_us_per_step_total": round(sum(kernels.values()), 1),
        "kernels": [(n, round(us, 1), counts[n] / steps) for n, us in top],
        "host_top": sorted(((n, round(us, 1)) for n, us in host.items()), key=lambda x: -x[1])[:25],
    }


def trace_policy(engine: LLMEngine) -> list:
    """Record every goodput decision: (step, n, K, tokens by K, predicted ms by K)."""
    policy, records = engine.spec.policy, []
    choose = policy.choose

    def traced(reqs, load=NO_LOAD):
        ks = choose(reqs, load)
        if reqs:
            n, kt = len(reqs), max(ks) if ks else 0
            costs = [round(policy.cost.period_ms(n, k, load.prefill_tokens), 3)
                     for k in range(policy.k_max + 1)]  # fmt: skip
            records.append({"t": round(time.perf_counter(), 5), "n": n, "k": kt,
                            "extra": load.prefill_tokens, "probe": policy._probe is not None,
                            "cost_ms": costs})  # fmt: skip
        return ks

    policy.choose = traced
    observe = engine.spec.observe_period

    def observed(batch, resolved_s, after_idle):
        observe(batch, resolved_s, after_idle)
        records.append({"resolved": round(resolved_s, 5), "after_idle": after_idle})

    engine.spec.observe_period = observed
    return records


def timed_run(engine: LLMEngine, batch: int, sequential: int, new_tokens: int) -> dict:
    """`sequential` rounds of `batch` requests (each round submitted when the last ended)."""
    tokens, t0 = 0, time.perf_counter()
    steps0 = engine.num_steps
    for i in range(sequential):
        add(engine, batch, 128, new_tokens, seed=100 + i)
        drain(engine)
        tokens += batch * new_tokens
    seconds = time.perf_counter() - t0
    return {"batch": batch, "tok_s": round(tokens / seconds, 1),
            "ms_per_step": round(seconds * 1e3 / (engine.num_steps - steps0), 3)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="diag")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--skip-smol", action="store_true", help="only the 8B kernel profiles")
    ap.add_argument("--only-plain", action="store_true", help="of the 8B engines, plain only")
    ap.add_argument("--no-pdl", action="store_true",
                    help="kernels launched without PDL: each kernel's profiled time is its own "
                         "run, not also its wait for the one before")  # fmt: skip
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64],
                    help="the 8B engines' profiled batch sizes")
    ap.add_argument("--ab-invariance", action="store_true",
                    help="also the 8B engines with --disable-batch-invariance")
    args = ap.parse_args()
    cuda = not args.tiny
    device = "cuda" if cuda else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    base = dict(device=device, dtype="bfloat16", max_num_batched_tokens=4096,
                max_model_len=2048, disable_pdl=args.no_pdl)  # fmt: skip
    if not args.skip_8b:
        shape = replace(LLAMA_8B, **TINY) if args.tiny else LLAMA_8B
        model = random_model(shape, device)
        head = random_head(shape, Path(tempfile.mkdtemp()) / "head", 1000 if args.tiny else 32000)
        spec = dict(speculative_algorithm="eagle3", speculative_draft_model_path=str(head),
                    speculative_num_steps=3, speculative_simulate_acceptance=3.0)  # fmt: skip
        cfg = dict(base, max_num_seqs=64, cuda_graph_max_batch=64,
                   kv_cache_bytes=2**26 if args.tiny else 16 * 2**30)  # fmt: skip
        engines = [
            ("plain", {"speculative_algorithm": "none"}),
            ("eagle3 policy off", {**spec, "speculative_policy": "off"}),
            ("eagle3 fixed K=3", {**spec, "speculative_policy": "fixed"}),
        ][: 1 if args.only_plain else 3]
        if args.ab_invariance:
            engines += [(f"{name}, batch variant", {**extra, "disable_batch_invariance": True})
                        for name, extra in engines]  # fmt: skip
        for name, extra in engines:
            batches = args.batches
            engine = LLMEngine(EngineConfig(**cfg, **extra), model=model)
            add(engine, 4, 64, 16)
            drain(engine)
            result[f"8b {name}"] = [profile(engine, b, cuda) for b in batches]
            selector = getattr(engine, "gemv_selector", None)
            if selector is not None and name == "plain":  # what served each GEMV shape
                plan = GemvPlan(selector.measured, selector.row_buckets)
                result["8b plain gemv plan"] = plan.summary()
            print(name, json.dumps(result[f"8b {name}"])[:3000], flush=True)
            del engine
        del model
        if cuda:
            torch.cuda.empty_cache()
    if args.skip_smol:
        (out / "diag.json").write_text(json.dumps(result, indent=1))
        return
    shape = replace(SMOLLM2, **TINY) if args.tiny else SMOLLM2
    model = random_model(shape, device)
    head = random_head(shape, Path(tempfile.mkdtemp()) / "head", 1000 if args.tiny else 11264)
    spec = dict(speculative_algorithm="eagle3", speculative_draft_model_path=str(head),
                speculative_num_steps=3, speculative_simulate_acceptance=0.68)  # fmt: skip
    cfg = dict(base, max_num_seqs=64, cuda_graph_max_batch=64,
               kv_cache_bytes=2**26 if args.tiny else 4 * 2**30)  # fmt: skip
    new_tokens = 32 if args.tiny else 256
    for name, extra in [("plain", {"speculative_algorithm": "none"}),
                        ("fixed K=3", {**spec, "speculative_num_steps": 3,
                                       "speculative_policy": "fixed"}),
                        ("goodput", {**spec, "speculative_policy": "goodput"})]:  # fmt: skip
        engine = LLMEngine(EngineConfig(**cfg, **extra), model=model)
        add(engine, 8, 64, 16)
        drain(engine)
        records = trace_policy(engine) if name == "goodput" else None
        rows = [timed_run(engine, 1, 6, new_tokens), timed_run(engine, 8, 2, new_tokens),
                timed_run(engine, 64, 2, new_tokens)]  # fmt: skip
        entry = {
            "rows": rows,
            "spec": {k: v for k, v in engine.stats().items() if k.startswith("spec_")},
        }
        if records is not None:
            (out / "goodput_trace.json").write_text(json.dumps(records))
            entry["trace_len"] = len(records)
        result[f"smollm2-shape {name}"] = entry
        print(name, json.dumps(entry)[:2000], flush=True)
        del engine
    (out / "diag.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
