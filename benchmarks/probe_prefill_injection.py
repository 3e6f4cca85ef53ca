"""Probe (not committed): what a prefill chunk costs a decode batch, plain vs fixed K=1."""
import gc, json, sys, time, tempfile, os
from pathlib import Path
import torch
sys.path.insert(0, "benchmarks")
from gpu_engine import LLAMA_8B, random_model, random_head, run, sync
from specserve.core.config import EngineConfig
from specserve.core.sampling_params import SamplingParams
from specserve.engine.engine import LLMEngine

OUT = Path(os.environ.get("OUT", "/tmp/out"))
batches = [int(x) for x in sys.argv[1].split(",")]
names = sys.argv[2].split(",")
from dataclasses import replace
DEV = "cpu" if os.environ.get("TINY") else "cuda"
SHAPE = replace(LLAMA_8B, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=8) if DEV == "cpu" else LLAMA_8B
model = random_model(SHAPE, DEV)
head = random_head(SHAPE, Path(tempfile.mkdtemp()) / "head")
base = dict(device=DEV, dtype="bfloat16", max_num_seqs=256, kv_cache_bytes=(2**27 if DEV == "cpu" else 24 * 2**30),
            max_num_batched_tokens=2048, max_model_len=4096)
spec = dict(speculative_algorithm="eagle3", speculative_draft_model_path=str(head),
            speculative_simulate_acceptance=1.5)
configs = {"plain": {"speculative_algorithm": "none"},
           "k1": {**spec, "speculative_policy": "fixed", "speculative_num_steps": 1},
           "k3": {**spec, "speculative_policy": "fixed", "speculative_num_steps": 3},
           "goodput": {**spec, "speculative_policy": "goodput", "speculative_num_steps": 3}}
gen = torch.Generator().manual_seed(0)
def prompt():
    return torch.randint(0, 32000, (512,), generator=gen).tolist()
params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)

def produced(engine, gone):
    return gone + sum(len(r.output_token_ids) for r in engine.requests.values())

def phase(engine, steps, every, live, gone):
    sync(); t0 = time.perf_counter(); n0 = engine.num_steps; d0 = engine.loop.totals['device_step_ms']; p0 = produced(engine, gone)
    injections = 0
    w0 = dict(engine.loop.stats()['loop_wait_reasons']); walls = []
    for i in range(steps):
        if every and i % every == 0:
            old = live.pop(0)
            gone += len(engine.requests[old].output_token_ids)
            engine.abort_request(old)
            live.append(engine.add_request(prompt(), params)); injections += 1
        ts = time.perf_counter(); engine.step(); walls.append(round((time.perf_counter() - ts) * 1e3, 2))
    sync(); wall = time.perf_counter() - t0
    nsteps = engine.num_steps - n0; devms = engine.loop.totals['device_step_ms'] - d0
    toks = produced(engine, gone) - p0
    return gone, dict(every=every, steps=steps, wall_ms_per_step=round(wall / steps * 1e3, 3),
                      device_ms_per_step=round(devms / max(1, nsteps), 3), injections=injections,
                      tok_s=round(toks / wall, 1), tokens=toks, engine_steps=nsteps, waits={k: v - w0.get(k, 0) for k, v in engine.loop.stats()['loop_wait_reasons'].items() if v - w0.get(k, 0)}, walls=walls[:40], dev=[round(x, 2) for x in list(engine.loop.times.step_ms)[-nsteps:][:40]])

results = {}
for name in names:
    engine = LLMEngine(EngineConfig.from_flags(**base, **configs[name]), model=model)
    gc.collect(); gc.freeze()
    for b in batches:
        run(engine, b, 512, 24)  # compile
    for b in batches:
        live = [engine.add_request(prompt(), params) for _ in range(b)]
        while any(r.cached_len < len(r.prompt_token_ids) for r in engine.requests.values()):
            engine.step()
        engine.loop.drain()
        gone = 0
        rows = []
        for every in (0, 4, 2, 0):
            gone, row = phase(engine, 96, every, live, gone)
            rows.append(row); print(name, b, row, flush=True)
        if os.environ.get("PROFILE") and b == batches[0]:
            from torch.profiler import profile, ProfilerActivity
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                gone, row = phase(engine, 16, 4, live, gone)
            tab = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60)
            (OUT / f"prof_{name}_{b}.txt").write_text(tab)
            print(tab[:6000], flush=True)
            prof.export_chrome_trace(str(OUT / f"trace_{name}_{b}.json"))
        for rid in live:
            engine.abort_request(rid)
        while engine.has_unfinished():
            engine.step()
        results[f"{name}@{b}"] = rows
    if engine.spec is not None:
        print(name, {k: v for k, v in engine.stats().items() if k.startswith("spec_")}, flush=True)
    gc.unfreeze(); del engine; gc.collect(); torch.cuda.empty_cache()
(OUT / "mixed.json").write_text(json.dumps(results, indent=1))
for k, rows in results.items():
    print(k, [(r["every"], r["device_ms_per_step"], r["wall_ms_per_step"], r["tok_s"]) for r in rows])
