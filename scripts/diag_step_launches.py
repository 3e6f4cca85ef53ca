"""What a small-model engine step launches on the GPU outside its CUDA graphs, per step.

A SmolLM2-135M-shaped random model (diag_host_pace.py's) at a batch size, plain and EAGLE-3
fixed K=3 (the random head's own acceptance, about none: greedy verification inside the
verify graphs, as on the default model), steady decode steps under torch.profiler: the CUDA
runtime and driver calls of the host thread that put work on the device (kernel launches,
copies, graph launches), each with the op it came from, and the other runtime calls (event
records, waits). On these models a step is paced by the device once the host keeps up
(gpu_default_model.md, session 17), and every launch outside a graph costs the device a few
microseconds however small its work: the list says which remain. Needs CUDA.

    PYTHONPATH=src python scripts/diag_step_launches.py --out $OUT/launches
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_host_pace import SMOLLM2  # noqa: E402
from gpu_engine_bench import random_head, random_model  # noqa: E402

from specserve.config import EngineConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402

# runtime and driver calls that put work on the device (kernels, copies, fills, graphs)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaMemcpyAsync", "cudaMemsetAsync", "cudaGraphLaunch")  # fmt: skip


def _origin(event) -> str:
    """The op a launch came from: its nearest profiled parent (an aten op), else "(no aten
    parent)": a Triton kernel's launch, a graph's, or another direct call."""
    parent = event.cpu_parent
    return parent.name if parent is not None else "(no aten parent)"


def profile_steps(engine: LLMEngine, batch: int, steps: int) -> dict:
    """Device work the host launches per steady decode step: by call and by the op it came
    from, and the other runtime calls (event records and waits, syncs)."""
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 30000 + 1 for j in range(64)], params)
    for _ in range(32):  # prefill and warm steps
        engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    launches, others = Counter(), Counter()
    for e in prof.events():
        if e.name in LAUNCHES:
            launches[(e.name, _origin(e))] += 1
        elif e.name.startswith("cuda") or (e.name.startswith("cu") and e.name[2:3].isupper()):
            others[e.name] += 1
    per = lambda c: round(c / steps, 2)  # noqa: E731
    return {"steps": steps,
            "launches_per_step": per(sum(launches.values())),
            "graph_launches_per_step": per(sum(v for (n, _), v in launches.items()
                                               if n == "cudaGraphLaunch")),
            "launches": [[n, o, per(v)] for (n, o), v in launches.most_common()],
            "other_runtime_calls": {k: per(v) for k, v in others.most_common()}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("launches"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    model = random_model(SMOLLM2, "cuda")
    head = random_head(SMOLLM2, Path(tempfile.mkdtemp()) / "head")
    base = dict(device="cuda", dtype="bfloat16", max_num_seqs=16, cuda_graph_max_batch=16,
                kv_cache_bytes=2**30, max_num_batched_tokens=4096,
                max_model_len=4096)  # fmt: skip
    spec = dict(speculative_algorithm="eagle3", speculative_draft_model_path=str(head),
                speculative_num_steps=3, speculative_policy="fixed")  # fmt: skip
    result = {"batch": args.batch}
    for name, extra in (("plain", {"speculative_algorithm": "none"}), ("eagle3 K=3 fixed", spec)):
        engine = LLMEngine(EngineConfig(**base, **extra), model=model)
        result[name] = profile_steps(engine, args.batch, args.steps)
        print(name, json.dumps(result[name], indent=1), flush=True)
        del engine
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diag_step_launches.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
