"""Probe (not committed): Poisson arrivals in-process (no HTTP): plain vs fixed K=1 vs goodput."""
import gc, json, os, random, sys, tempfile, time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
import torch
sys.path.insert(0, "benchmarks")
from gpu_engine import LLAMA_8B, random_model, random_head, run, sync
from specserve.core.config import EngineConfig
from specserve.core.sampling_params import SamplingParams
from specserve.engine.engine import LLMEngine

OUT = Path(os.environ.get("OUT", "/tmp/out"))
TINY = bool(os.environ.get("TINY"))
DEV = "cpu" if TINY else "cuda"
SHAPE = replace(LLAMA_8B, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=8) if TINY else LLAMA_8B
rates = [float(x) for x in sys.argv[1].split(",")]
names = sys.argv[2].split(",")
SECONDS = float(os.environ.get("SECONDS_", "20"))
OUTLEN = int(os.environ.get("OUTLEN", "256"))
model = random_model(SHAPE, DEV)
head = random_head(SHAPE, Path(tempfile.mkdtemp()) / "head")
base = dict(device=DEV, dtype="bfloat16", max_model_len=4096)
if TINY:
    base["kv_cache_bytes"] = 2**27
spec = dict(speculative_algorithm="eagle3", speculative_draft_model_path=str(head),
            speculative_simulate_acceptance=0.342508)
configs = {"plain": {"speculative_algorithm": "none"},
           "k1": {**spec, "speculative_policy": "fixed", "speculative_num_steps": 1},
           "goodput": {**spec, "speculative_policy": "goodput", "speculative_num_steps": 3}}
params = SamplingParams(max_tokens=OUTLEN, temperature=0.0, ignore_eos=True)

def poisson(engine, rate, seed=0, seconds=None):
    rng = random.Random(seed)
    n = int(rate * (seconds or SECONDS))
    t, arrivals = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate); arrivals.append(t)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 32000, (n, 512), generator=g).tolist()
    comp = []
    sched = engine.scheduler.schedule
    def wrapped(*a, **k):
        batch = sched(*a, **k)
        dec = sum(1 for s in batch if s.decoding)
        pre = sum(s.num_tokens for s in batch if not s.decoding)
        kk = max((s.draft_len for s in batch), default=0)
        comp.append((len(batch), dec, pre, kk))
        return batch
    engine.scheduler.schedule = wrapped
    start_of, lat, first = {}, [], {}
    i = 0; walls = []
    n0 = engine.num_steps; dlen0 = len(engine.loop.times.step_ms)
    t0 = time.perf_counter()
    while i < n or engine.has_unfinished():
        now = time.perf_counter() - t0
        while i < n and arrivals[i] <= now:
            rid = engine.add_request(prompts[i], params); start_of[rid] = arrivals[i]; i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[i] - now)); continue
        ts = time.perf_counter(); outs = engine.step(); te = time.perf_counter()
        walls.append((te - ts) * 1e3)
        for o in outs:
            if o.request_id in start_of and o.request_id not in first and o.token_ids:
                first[o.request_id] = te - t0 - start_of[o.request_id]
            if o.finished and o.request_id in start_of:
                lat.append(te - t0 - start_of[o.request_id])
    engine.scheduler.schedule = sched
    dur = time.perf_counter() - t0
    steps = engine.num_steps - n0
    dev = list(engine.loop.times.step_ms)[-steps:]
    # split steps by composition (schedule calls align with device spans: same order)
    m = min(len(dev), len(comp))
    groups = defaultdict(list)
    for (rows, dec, pre, kk), d in zip(comp[-m:], dev[-m:]):
        groups[("prefill" if pre else "decode", kk)].append((d, rows, pre))
    split = {f"{a} K={k}": dict(n=len(v), dev_ms=round(sum(x[0] for x in v) / len(v), 2),
                                 rows=round(sum(x[1] for x in v) / len(v), 1),
                                 prefill_tok=round(sum(x[2] for x in v) / len(v), 0))
             for (a, k), v in sorted(groups.items())}
    return dict(rate=rate, requests=n, finished=len(lat), mean_latency_ms=round(sum(lat) / max(1, len(lat)) * 1e3, 1),
                mean_ttft_ms=round(sum(first.values()) / max(1, len(first)) * 1e3, 1), seconds=round(dur, 2),
                steps=steps, wall_ms=round(sum(walls) / max(1, len(walls)), 2),
                dev_ms=round(sum(dev) / max(1, len(dev)), 2), tok_s=round(n * OUTLEN / dur, 1), split=split)

results = {}
for name in names:
    engine = LLMEngine(EngineConfig.from_flags(**base, **configs[name]), model=model)
    gc.collect(); gc.freeze()
    run(engine, 48, 512, 24)
    poisson(engine, rates[0], seed=99, seconds=4)  # warm: a short open-loop round, its shapes compiled
    for r in rates:
        res = poisson(engine, r)
        results[f"{name}@{r}"] = res
        print(name, json.dumps(res), flush=True)
    if engine.spec is not None:
        st = engine.stats()
        print(name, {k: st[k] for k in ("spec_steps_by_step_k", "spec_policy_period_ms", "spec_policy_mode_factor") if k in st}, flush=True)
    gc.unfreeze(); del engine; gc.collect()
    if DEV == "cuda": torch.cuda.empty_cache()
(OUT / "pe.json").write_text(json.dumps(results, indent=1))
for k, v in results.items():
    print(k, v["mean_latency_ms"], v["mean_ttft_ms"], v["dev_ms"], v["steps"], v["tok_s"])
