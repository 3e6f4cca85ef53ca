"""Engine-level host parts, closed loop, SmolLM2 shape with dummy weights, side by side in
one process (engines take turns each round): none / off / goodput (dormant at low simulated
acceptance) / fixed K=3. Prints per-step means: wall period, host parts, device span."""
import os, random, sys, time, json
import torch
from specserve import LLM, SamplingParams
C = int(sys.argv[1]); STEPS = int(sys.argv[2]); ROUNDS = int(sys.argv[3]); ACC = float(sys.argv[4])
modes = sys.argv[5].split(",")
common = dict(model="smollm2-135m", load_format="dummy", kv_cache_bytes=2 << 30)
def build(mode):
    if mode == "none":
        return LLM(**common)
    pol = {"off": "off", "goodput": "goodput", "fixed": "fixed"}[mode]
    return LLM(**common, speculative_algorithm="eagle3", speculative_policy=pol,
               speculative_num_steps=3, speculative_simulate_acceptance=ACC)
engines = {m: build(m) for m in modes}
state = {}
for m, llm in engines.items():
    eng = llm.engine; rng = random.Random(0)
    def add(eng=eng, rng=rng):
        p = SamplingParams(max_tokens=rng.randrange(160, 352), temperature=0.0, ignore_eos=True)
        eng.add_request([rng.randrange(100, 40000) for _ in range(rng.randrange(24, 72))], p)
    for _ in range(C): add()
    state[m] = add
def run(m, steps):
    eng = engines[m].engine; add = state[m]; loop = eng.loop
    h0 = dict(loop.host_ms); t0 = dict(loop.totals); k0 = dict(loop.kind_steps)
    tr = eng.spec.policy.trace if eng.spec is not None and eng.spec.policy is not None else None
    d0 = tr.dormant_steps if tr else 0
    s = time.perf_counter()
    for _ in range(steps):
        for o in eng.step():
            if o.finished: add()
    wall = (time.perf_counter() - s) * 1e3 / steps
    host = {k: (v - h0.get(k, 0.0)) / steps for k, v in loop.host_ms.items()}
    tot = {k: (v - t0.get(k, 0.0)) / steps for k, v in loop.totals.items()}
    kinds = {k: v - k0.get(k, 0) for k, v in loop.kind_steps.items() if v - k0.get(k, 0)}
    dorm = (tr.dormant_steps - d0) / steps if tr else 0
    return wall, host, tot, kinds, dorm
for m in modes: run(m, 200)  # warm-up
res = {m: [] for m in modes}
for r in range(ROUNDS):
    order = modes[r % len(modes):] + modes[: r % len(modes)]
    for m in order:
        wall, host, tot, kinds, dorm = run(m, STEPS)
        res[m].append(wall)
        print(f"r{r} {m:8s} period {wall:.3f} ms | " + " ".join(f"{k} {v:.3f}" for k, v in sorted(host.items()))
              + f" | dev {tot.get('device_step_ms', 0):.3f} gap {tot.get('device_gap_ms', 0):.3f} wait {tot.get('host_wait_ms', 0):.3f} | dormant {dorm:.2f} | {kinds}", flush=True)
for m in modes:
    v = sorted(res[m]); print(m, "median period %.3f ms" % v[len(v) // 2], ["%.3f" % x for x in res[m]])
