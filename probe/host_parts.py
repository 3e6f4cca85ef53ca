"""One-off probe: the engine's host work per step at 1 and 8 requests (closed loop),
default model's shape with random weights, EAGLE-3 at simulated acceptance, by policy."""
import cProfile, pstats, io, os, sys, time, random, torch
N = int(os.environ.get("N", "1500"))
from specserve import LLM, SamplingParams
pol = sys.argv[1]
kw = dict(load_format="dummy", kv_cache_bytes=2 << 30)
if pol == "none":
    kw["speculative_algorithm"] = "none"
else:
    kw.update(speculative_algorithm="eagle3", speculative_policy=pol, speculative_simulate_acceptance=2.1)
llm = LLM(os.environ.get("MODEL", "smollm2-135m"), **kw)
eng, loop = llm.engine, llm.engine.loop
rng = random.Random(0)
def closed(conc, steps, prof=None):
    active = 0
    for _ in range(conc):
        eng.add_request([rng.randrange(100, 40000) for _ in range(40)], SamplingParams(max_tokens=256, ignore_eos=True))
    toks = 0; t0 = time.perf_counter(); h0 = dict(loop.host_ms)
    if prof: prof.enable()
    for _ in range(steps):
        for o in eng.step():
            toks += o.num_new_tokens if hasattr(o, "num_new_tokens") else 1
            if o.finished:
                eng.add_request([rng.randrange(100, 40000) for _ in range(40)], SamplingParams(max_tokens=256, ignore_eos=True))
    if prof: prof.disable()
    dt = time.perf_counter() - t0
    parts = {k: round((v - h0.get(k, 0)) / steps, 3) for k, v in loop.host_ms.items()}
    while eng.has_unfinished():
        for r in list(eng.requests): eng.abort_request(r)
        eng.step()
    return dt / steps * 1e3, parts
for conc in (1, 8):
    closed(conc, N // 5)
    ms, parts = closed(conc, N)
    print(f"== {pol} c{conc}: {ms:.3f} ms a step, host parts {parts}", flush=True)
    if os.environ.get("PROF") == "0":
        continue
    p = cProfile.Profile()
    closed(conc, N, p)
    s = io.StringIO()
    pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(28)
    lines = [l for l in s.getvalue().splitlines() if l.strip()]
    print("\n".join(l[:150] for l in lines[3:40]), flush=True)
