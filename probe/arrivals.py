"""one-off probe: closed-loop arrivals in-process; per-step wall time by step kind; profiler of mixed steps."""
import sys, time, random, os
import torch
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

policy = sys.argv[1]; C = int(sys.argv[2]); R = int(sys.argv[3]); IL = int(os.environ.get("IL", 48)); OL = int(os.environ.get("OL", 160))
dev = "cuda" if torch.cuda.is_available() else "cpu"
kw = dict(load_format="dummy", speculative_algorithm="eagle3", speculative_simulate_acceptance=1.5, speculative_policy=policy)
if dev == "cpu":
    kw.update(device="cpu")
llm = LLM(**kw)
eng = llm.engine
rng = random.Random(0)
V = min(eng.model_config.vocab_size, 40000)
params = SamplingParams(max_tokens=OL, temperature=0.0, ignore_eos=True)
sort_key = "self_cuda_time_total" if dev == "cuda" else "self_cpu_time_total"
import collections, functools
PH = collections.defaultdict(float); PHN = collections.Counter(); CUR = ["decode"]
def timed(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); PH[(CUR[0], label)] += time.perf_counter() - t; PHN[(CUR[0], label)] += 1; return r
    setattr(obj, name, w)
spec = eng.spec
timed(eng.runner, "prepare", "prepare"); timed(eng.runner, "forward", "forward"); timed(eng.runner, "sample_async", "sample")
timed(eng.loop, "_process", "process"); timed(eng.loop, "_resolve", "resolve"); timed(eng.scheduler, "schedule", "schedule")
if spec is not None:
    for n in ("propose", "catch_up_prefill", "features", "commit"):
        if hasattr(spec.proposer, n): timed(spec.proposer, n, n)
    timed(spec, "observe", "observe"); timed(spec, "observe_period", "observe_period")
    if hasattr(spec, "choose"): pass
def add():
    eng.add_request([rng.randrange(100, V) for _ in range(IL)], params)

def run(N, prof_steps=0, label=""):
    for _ in range(C): add()
    sent, done, stats, prof, taken = C, 0, {}, None, 0
    t_start = time.perf_counter(); st0 = dict(eng.stats())
    while eng.has_unfinished():
        kind = "mixed" if eng.scheduler.waiting or any(r.cached_len < len(r.prompt_token_ids) for r in eng.scheduler.running) else "decode"
        if prof_steps and prof is None and done > C and kind == "mixed":
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]); prof.__enter__()
        CUR[0] = kind
        t0 = time.perf_counter(); outs = eng.step(); t1 = time.perf_counter()
        if prof is not None:
            taken += 1
            if taken >= prof_steps:
                if dev == "cuda": torch.cuda.synchronize()
                prof.__exit__(None, None, None)
                print(f"### profile {label}: {taken} steps from a mixed one")
                print(prof.key_averages().table(sort_by=sort_key, row_limit=30))
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
                prof, prof_steps = None, 0
        s = stats.setdefault(kind, [0, 0.0]); s[0] += 1; s[1] += t1 - t0
        for o in outs:
            if o.finished:
                done += 1
                if sent < N:
                    add(); sent += 1
    wall = time.perf_counter() - t_start; st1 = eng.stats()
    if label == "closed":
        for k in sorted(PH): print("  phase", k, PHN[k], f"{1e3*PH[k]/max(1,stats.get(k[0],[1])[0]):.3f} ms/step")
    PH.clear(); PHN.clear()
    steps = st1["steps"] - st0["steps"]
    print(f"{label} {policy} C={C} N={N}: {N*OL/wall:.0f} tok/s wall {wall:.2f}s steps {steps}",
          {k: (v[0], round(1e3 * v[1] / v[0], 3)) for k, v in stats.items()},
          {k: round((st1[k] - st0[k]) / steps, 3) for k in ("device_step_ms", "device_gap_ms", "host_wait_ms")}, flush=True)

run(C, label="warm")
run(C, label="one-wave")
run(R * C, label="closed")
if os.environ.get("PROF"): run(C * 3, prof_steps=int(os.environ.get("PROF", 6)), label="prof")
