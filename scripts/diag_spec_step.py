"""Where a speculative step's device time goes at batch 1 (issue 5's 2.4x target): the
8B-shaped target with a random EAGLE-3 head, K=3 fixed, simulated acceptance 3.0, PDL off
(so that each kernel's profiled duration is its own, not a wait for its predecessor).

Writes every kernel of a few steady steps in device order (name, start offset and duration
in microseconds) and a summary per step part: a marker kernel (torch.cuda._sleep, a few
cycles) launched before the proposer and before the target's forward splits each step into
the drafter's part (with the step's input uploads) and the target's (forward, sampling).
Compare each part's microseconds with its weight bytes at HBM bandwidth.

    PYTHONPATH=src python scripts/diag_spec_step.py --out $OUT/spec_step
    PYTHONPATH=src python scripts/diag_spec_step.py --tiny --out /tmp/spec_step   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_profile import TINY, add, drain, sync  # noqa: E402
from gpu_engine_bench import LLAMA_8B, random_head, random_model  # noqa: E402

from specserve.config import EngineConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402


def timeline(engine: LLMEngine, steps: int) -> list[list]:
    """Kernels of `steps` steady engine steps in device order: [name, start us, us]."""
    add(engine, 1, 512, 200)
    while any(r.cached_len < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    for _ in range(10):
        engine.step()
    sync()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    drain(engine)
    kernels = sorted((e.time_range.start, e.time_range.elapsed_us(), e.name[:80])
                     for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)  # fmt: skip
    if not kernels:
        return []
    t0 = kernels[0][0]
    return [[name, round(start - t0, 1), round(us, 1)] for start, us, name in kernels]


MARKER = "spin_kernel"


def mark(engine: LLMEngine) -> None:
    """A marker kernel before each proposer call and each target forward."""

    def marked(fn):
        def call(*args, **kwargs):
            torch.cuda._sleep(1)
            return fn(*args, **kwargs)

        return call

    if engine.spec is not None:
        engine.spec.proposer.propose = marked(engine.spec.proposer.propose)
    engine.runner.forward = marked(engine.runner.forward)


def parts(kernels: list[list], labels: tuple[str, ...]) -> list[dict]:
    """Split the timeline at the markers, labelled in turn by `labels`: per part, its span,
    kernel microseconds in all and by name."""
    starts = [i for i, k in enumerate(kernels) if MARKER in k[0]]
    out = []
    for n, (a, b) in enumerate(zip(starts, starts[1:])):
        by_name: dict[str, float] = defaultdict(float)
        for name, _, us in kernels[a + 1 : b]:
            by_name[name] += us
        out.append({
            "part": labels[n % len(labels)],
            "span_us": round(kernels[b][1] - kernels[a][1], 1),
            "kernel_us": round(sum(by_name.values()), 1),
            "kernels": b - a - 1,
            "by_name": sorted(((k, round(v, 1)) for k, v in by_name.items()), key=lambda x: -x[1]),
        })  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="spec_step")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    cuda = not args.tiny
    device = "cuda" if cuda else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = replace(LLAMA_8B, **TINY) if args.tiny else LLAMA_8B
    model = random_model(shape, device)
    head = random_head(shape, Path(tempfile.mkdtemp()) / "head", 1000 if args.tiny else 32000)
    cfg = EngineConfig(
        device=device, dtype="bfloat16", max_num_batched_tokens=4096, max_model_len=2048,
        max_num_seqs=8, cuda_graph_max_batch=8, kv_cache_bytes=2**26 if args.tiny else 2**32,
        speculative_algorithm="eagle3", speculative_draft_model_path=str(head),
        speculative_num_steps=3, speculative_simulate_acceptance=3.0,
        speculative_policy="fixed", disable_pdl=True,
    )  # fmt: skip
    result = {}
    for name, extra in [("eagle3 fixed K=3", {}), ("plain", {"speculative_algorithm": "none"})]:
        engine = LLMEngine(replace(cfg, **extra), model=model)
        add(engine, 1, 64, 16)
        drain(engine)
        if cuda:
            mark(engine)
        kernels = timeline(engine, args.steps)
        labels = ("draft", "target") if engine.spec is not None else ("target",)
        result[name] = {"kernels": kernels, "parts": parts(kernels, labels)}
        print(name, json.dumps(result[name]["parts"])[:4000], flush=True)
        del engine
    (out / "spec_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
