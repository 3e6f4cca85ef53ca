"""Host work of EAGLE-3 engine steps, with the device work made negligible (CPU only).

The sibling of host_step_bench.py for speculative engines: a tiny random Llama target
(hidden 64, 4 layers) and a random EAGLE-3 head, run through the paths a CUDA engine takes
(the target's graph runner padded to batch buckets, the drafter's graphs with chain graphs),
with every graph "replay" free: each captured shape runs once eagerly at start-up and a
replay hands back those outputs, as a CUDA graph hands back its static outputs. So a step
costs what the host spends on it: scheduling, the drafter's inputs, packing, copies into
static buffers, the eager ops around the graphs (target logits of the sampled rows,
verification; EAGLE-3's fc projection of the features runs inside the target's graph), the
step loop and outputs.

Configurations: plain (no drafter), EAGLE-3 loaded with the policy off (K=0 every step)
EAGLE-3 fixed K=3 (simulated acceptance 0.7 per draft, about the shipped head's real rate
on the default model) and EAGLE-3 under the goodput policy (same acceptance; its K per step
and probes as it decides, so its row also shows how often the loop waited, and why);
overlap loop on, greedy, ignore_eos. For each batch size:
milliseconds per step, the mean over a window of steps that includes the drafter's
ride-along catch-ups, and the median of 10-step blocks; microseconds per request-step.
Times are the thread's CPU time (`time.thread_time`), so other jobs on a shared machine
count less; configurations are interleaved and the best of --repeats runs is kept.

`--ops` also counts torch calls per step (a TorchFunctionMode: copies, .to(), cat/stack,
linears, indexing, everything) and host-to-device staging buffers that a CUDA engine pins
(on the CPU nothing is pinned, so the call sites that pin on CUDA are counted). On a GPU
each torch call costs the host several microseconds, which the CPU time underrates.

    python scripts/host_step_eagle3.py                       # batch 1, 8, 64
    python scripts/host_step_eagle3.py --batch 8 --profile   # plus a cProfile per config
    python scripts/host_step_eagle3.py --ops --json out.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.tiny_models (random checkpoints), scripts.*

from scripts.host_step_bench import drain, start_batch  # noqa: E402
from scripts.torch_op_counts import IGNORED, CountOps, fake_arena, pin_sites  # noqa: E402
from specserve.config import EngineConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.runtime.cuda_graphs import CudaGraphRunner, default_batch_buckets  # noqa: E402
from specserve.spec.eagle3 import capture_drafter_graphs  # noqa: E402

K = 3
CONFIGS = {
    "plain": dict(speculative_algorithm=None),
    "K=0 drafter": dict(speculative_algorithm="eagle3", speculative_policy="off"),
    "K=3": dict(speculative_algorithm="eagle3", speculative_policy="fixed",
                speculative_simulate_acceptance=0.7),
    "goodput": dict(speculative_algorithm="eagle3", speculative_policy="goodput",
                    speculative_simulate_acceptance=0.7),
}  # fmt: skip


def cheap_simulated_acceptance() -> None:
    """Simulated acceptance draws its uniforms with a counter hash (a dozen device ops that
    real acceptance does not run); here they come from a pool of precomputed tensors: one op,
    as the comparison of drafts with the target's argmax."""
    from specserve.spec import verify

    gen = torch.Generator().manual_seed(0)
    pool = [torch.rand(256, K, generator=gen) for _ in range(97)]
    turn = iter(range(1 << 62))

    def uniforms(seeds, positions, k_max, stream):
        return pool[next(turn) % len(pool)][: seeds.shape[0], :k_max]

    verify._uniforms = uniforms


def make_models(folder: Path) -> tuple[str, str]:
    from tests.tiny_models import make_random_eagle3_head, make_tiny_model

    target = make_tiny_model(folder / "target", "llama", num_layers=4)
    cfg_path = target / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = 4096  # room for long runs
    cfg_path.write_text(json.dumps(cfg))
    head = make_random_eagle3_head(folder / "head", target, 200)
    return str(target), str(head)


class FreeReplay:
    """A captured graph whose replay costs nothing (its outputs were computed once)."""

    def replay(self) -> None:
        pass


def install_free_graphs(engine: LLMEngine, max_batch: int) -> None:
    """The target's graph runner and the drafter's graphs, as on CUDA, replays free."""
    runner, spec = engine.runner, engine.spec
    k = K if spec is not None else 0
    graphs = CudaGraphRunner(
        runner.model, runner.kv.layers, runner.backend, default_batch_buckets(max_batch),
        tokens_per_request=tuple(range(1, k + 2)), max_seq_len=engine.max_model_len,
        aux_layer_ids=spec.aux_layer_ids if spec is not None else (), use_graphs=False,
        feature_writer=spec.proposer.feature_writer() if spec is not None else None,
    )  # fmt: skip
    with torch.inference_mode():
        graphs._graphs = {key: (FreeReplay(), *graphs._forward(*key)) for key in graphs.keys()}
    graphs.use_graphs = True
    runner.graphs = graphs
    if spec is None:
        return
    if spec.cost is not None:  # the goodput policy: verify steps padded, as with graphs
        spec.cost.padded = True
    proposer = spec.proposer
    store = getattr(proposer, "feature_store", None)
    if store is not None:  # fault its pages in now (a CPU artifact: device memory is mapped)
        store.fill_(1.0)
    drafter = capture_drafter_graphs(proposer, engine, use_graphs=False)
    with torch.inference_mode():
        drafter._graphs = {key: (FreeReplay(), drafter._run_key(*key)) for key in drafter.keys()}
    drafter.use_graphs = True
    proposer.graphs = drafter


def build(target: str, head: str, name: str, max_batch: int) -> LLMEngine:
    kw = dict(CONFIGS[name])
    if kw.get("speculative_algorithm"):
        kw["speculative_draft_model_path"] = head
    config = EngineConfig(
        model=target, dtype="float32", overlap_schedule="on", speculative_num_steps=K,
        num_kv_pages=max_batch * 260 + 8, max_num_seqs=max_batch, page_size=16, **kw,
    )  # fmt: skip
    engine = LLMEngine(config)
    install_free_graphs(engine, max_batch)
    return engine


def time_steps(engine: LLMEngine, batch: int, steps: int) -> dict:
    """Per-step wall times over `steps` steps of a batch started together."""
    start_batch(engine, batch, 4 * steps + 64)
    loop0 = engine.loop.stats()
    times, tokens = [], 0
    for _ in range(steps):
        t0 = time.thread_time()  # CPU time of this thread: other jobs on the machine
        outs = engine.step()  # do not count (the step never waits: the device is free)
        times.append(time.thread_time() - t0)
        tokens += sum(o.num_new_tokens for o in outs)
    loop = engine.loop.stats()
    drain(engine)
    blocks = [sum(times[i : i + 10]) / 10 for i in range(0, len(times) - 9, 10)]
    mean_ms = sum(times) / len(times) * 1e3
    reasons = {k: v - loop0["loop_wait_reasons"].get(k, 0)
               for k, v in loop["loop_wait_reasons"].items()}  # fmt: skip
    return {"mean_ms": mean_ms, "median_block_ms": statistics.median(blocks) * 1e3,
            "max_ms": max(times) * 1e3, "tokens_per_step": tokens / steps,
            "us_per_request_step": mean_ms * 1e3 / batch,
            "waits_per_step": (loop["loop_waits"] - loop0["loop_waits"]) / steps,
            "wait_reasons": {k: v for k, v in reasons.items() if v}}  # fmt: skip


def count_ops(engine: LLMEngine, batch: int, steps: int) -> dict:
    start_batch(engine, batch, 4 * steps + 64)
    pins: Counter = Counter()
    saved = []
    for owner, attr in pin_sites():
        fn = getattr(owner, attr)

        def counted(*a, _fn=fn, _name=attr, **kw):
            pins[_name] += 1
            return _fn(*a, **kw)

        saved.append((owner, attr, fn))
        setattr(owner, attr, counted)
    from specserve.runtime import packing

    if hasattr(packing, "pinned_int64"):
        saved.append((packing, "pinned_int64", packing.pinned_int64))
        packing.pinned_int64 = fake_arena()
    mode = CountOps()
    try:
        with mode:
            for _ in range(steps):
                engine.step()
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
    drain(engine)
    counts = {k: v for k, v in mode.counts.items() if k not in IGNORED}
    groups = {
        "copy_": counts.get("copy_", 0) + counts.get("index_copy_", 0),
        ".to()": counts.get("to", 0),
        "cat/stack": counts.get("cat", 0) + counts.get("stack", 0),
        "linear": counts.get("linear", 0),
        "index/slice": counts.get("__getitem__", 0) + counts.get("__setitem__", 0),
        "pinned staging (on CUDA)": sum(pins.values()),
        "all torch calls": sum(counts.values()),
    }
    per_step = {k: v / steps for k, v in groups.items()}
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:25]
    return {"per_step": per_step, "top": {k: v / steps for k, v in top},
            "pins": {k: v / steps for k, v in pins.items()}}  # fmt: skip


def profile(engine: LLMEngine, batch: int, steps: int, out) -> None:
    start_batch(engine, batch, 4 * steps + 64)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    drain(engine)
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=256, help="timed steps (2 ride-alongs)")
    ap.add_argument("--repeats", type=int, default=5, help="runs per cell (the best kept)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--ops", action="store_true", help="torch calls per step")
    ap.add_argument("--profile", action="store_true", help="cProfile of each config")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cheap_simulated_acceptance()
    print(f"# host work per step, free graph replays; {platform.machine()}, "
          f"Python {platform.python_version()}, torch {torch.__version__}")
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        target, head = make_models(Path(tmp))
        engines = {name: build(target, head, name, max(args.batch)) for name in args.configs}
        gc.collect()
        gc.freeze()
        for batch in args.batch:  # configurations interleaved: the machine's noise is shared
            runs: dict = {name: [] for name in engines}
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    runs[name].append(time_steps(engine, batch, args.steps))
            for name, engine in engines.items():
                best = min(runs[name], key=lambda r: r["mean_ms"])
                best["median_of_runs_ms"] = statistics.median(r["mean_ms"] for r in runs[name])
                results.setdefault(name, {})[batch] = best
                print(f"{name:12s} batch {batch:3d}: mean {best['mean_ms']:.3f} ms/step "
                      f"({best['us_per_request_step']:.1f} us/request-step; median of runs "
                      f"{best['median_of_runs_ms']:.3f}), median block "
                      f"{best['median_block_ms']:.3f}, max {best['max_ms']:.2f}, "
                      f"{best['tokens_per_step']:.2f} tokens/step, "
                      f"{best['waits_per_step']:.2f} waits/step {best['wait_reasons']}",
                      flush=True)  # fmt: skip
                if args.ops:
                    ops = count_ops(engine, batch, 64)
                    best["ops"] = ops
                    cells = ", ".join(f"{k} {v:.1f}" for k, v in ops["per_step"].items())
                    print(f"    per step: {cells}")
                    print("    top: " + ", ".join(f"{k} {v:.1f}" for k, v in ops["top"].items()))
        if args.profile:
            for name, engine in engines.items():
                print(f"\ncProfile, {name}, batch {max(args.batch)}, {args.steps} steps:")
                profile(engine, max(args.batch), args.steps, sys.stdout)
        gc.unfreeze()
        del engines
        gc.collect()
    print("\n| config | " + " | ".join(f"batch {b}: ms/step (us/req-step)" for b in args.batch)
          + " |")
    print("|---|" + "---|" * len(args.batch))
    for name, cells in results.items():
        row = [f"{c['mean_ms']:.3f} ({c['us_per_request_step']:.1f})" for c in cells.values()]
        print(f"| {name} | " + " | ".join(row) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
