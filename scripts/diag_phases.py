"""Per-phase step times of the engine on the GPU (8B-shaped random model), plain and EAGLE-3.

The synchronous step loop with a device sync after each phase (schedule, propose, prepare,
forward, sample, resolve + process), so each phase's time includes its device work.

    PYTHONPATH=src python scripts/diag_phases.py
    PYTHONPATH=src python scripts/diag_phases.py --tiny     # CPU smoke test
"""

import argparse
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
from specserve.sampling_params import SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(obj, name: str, acc: dict) -> None:
    """Wrap obj.name so that its calls (device work included) add to acc[name]."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        sync()
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        acc[name] += time.perf_counter() - t
        return out

    setattr(obj, name, wrapper)


def phases(engine: LLMEngine, batch: int, prompt_len: int, n_new: int, label: str) -> None:
    g = torch.Generator().manual_seed(0)
    for p in torch.randint(0, 32000, (batch, prompt_len), generator=g).tolist():
        engine.add_request(p, SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True))
    while any(r.cached_len < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    acc: dict = defaultdict(float)
    originals = [(engine.scheduler, "schedule"), (engine.runner, "prepare"),
                 (engine.runner, "forward"), (engine.runner, "sample_async")]
    if engine.spec is not None:
        originals.append((engine.spec.proposer, "propose"))
    for obj, name in originals:
        timed(obj, name, acc)
    steps, total = 0, 0.0
    while engine.has_unfinished():
        sync()
        t = time.perf_counter()
        engine.step()
        sync()
        total += time.perf_counter() - t
        steps += 1
    for obj, name in originals:
        delattr(obj, name)  # back to the class's method
    acc["rest (resolve, process)"] = total - sum(acc.values())
    ms = {k: round(v / steps * 1e3, 3) for k, v in acc.items()}
    print(label, "steps", steps, "ms/step", round(total / steps * 1e3, 3), ms, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a small shape on the CPU (smoke test)")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    tiny = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                head_dim=16, num_layers=8)  # fmt: skip
    shape = replace(LLAMA_8B, **tiny) if args.tiny else LLAMA_8B
    model = random_model(shape, device)
    head = random_head(shape, Path(tempfile.mkdtemp()) / "head", 1000 if args.tiny else 32000)
    base = dict(device=device, dtype="bfloat16", max_num_seqs=64, cuda_graph_max_batch=64,
                kv_cache_bytes=2**26 if args.tiny else 8 * 2**30, max_num_batched_tokens=4096,
                max_model_len=4096, overlap_schedule="off")  # fmt: skip
    spec = dict(speculative_algorithm="eagle3", speculative_draft_model_path=str(head),
                speculative_num_steps=3, speculative_simulate_acceptance=3.0,
                speculative_policy="fixed")  # fmt: skip
    prompt_len, n_new = (16, 6) if args.tiny else (512, 48)
    for name, extra in [("plain", {"speculative_algorithm": "none"}), ("eagle3 fixed", spec)]:
        engine = LLMEngine(EngineConfig(**base, **extra), model=model)
        for rep in range(2):
            for b in (1, 64):
                phases(engine, b, prompt_len, n_new, f"{name} rep{rep} batch{b}")
        del engine


if __name__ == "__main__":
    main()
