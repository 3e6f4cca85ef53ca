"""Per-phase step times of the engine on the GPU (8B-shaped random model), plain and EAGLE-3."""
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, "scripts")
from gpu_engine_bench import LLAMA_8B, random_head, random_model

from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.sampling_params import SamplingParams

model = random_model(LLAMA_8B, "cuda")
head = random_head(LLAMA_8B, Path(tempfile.mkdtemp()) / "head")
base = dict(device="cuda", dtype="bfloat16", max_num_seqs=64, cuda_graph_max_batch=64,
            kv_cache_bytes=8 * 2**30, max_num_batched_tokens=4096, max_model_len=4096)
spec = dict(speculative_algorithm="eagle3", speculative_draft_model_path=str(head),
            speculative_num_steps=3, speculative_simulate_acceptance=3.0,
            speculative_policy="fixed")

def mark(t: list) -> None:
    torch.cuda.synchronize()
    t.append(time.perf_counter())


def phases(engine, batch, n_new, label):
    g = torch.Generator().manual_seed(0)
    for p in torch.randint(0, 32000, (batch, 512), generator=g).tolist():
        engine.add_request(p, SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True))
    while any(r.cached_len < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    acc = dict.fromkeys(["schedule", "propose", "prepare", "forward", "sample", "process"], 0.0)
    steps = 0
    spec_ = engine.spec
    while engine.has_unfinished():
        t = [time.perf_counter()]
        batch_ = engine.scheduler.schedule(spec_.policy if spec_ else None)
        mark(t)
        drafting = [s for s in batch_ if s.draft_len > 0]
        if drafting:
            spec_.proposer.propose(drafting)
        mark(t)
        si = engine.runner.prepare(batch_)
        mark(t)
        hidden, aux = engine.runner.forward(si, spec_.aux_layer_ids if spec_ else ())
        mark(t)
        res = engine.runner.sample(si, hidden, spec_.simulate_rate if spec_ else None)
        mark(t)
        engine._process(batch_, si, res, aux)
        t.append(time.perf_counter())
        for k, a, b in zip(acc, t, t[1:]):
            acc[k] += b - a
        steps += 1
    print(label, "steps", steps, {k: round(v / steps * 1e3, 3) for k, v in acc.items()}, flush=True)

for name, extra in [("plain", {}), ("eagle3 fixed", spec)]:
    e = LLMEngine(EngineConfig(**base, **extra), model=model)
    for rep in range(2):
        for b in (1, 64):
            phases(e, b, 48, f"{name} rep{rep} batch{b}")
    del e
