"""Probe (session 59, removed in the next commit): closed loop of C clients in one process,
the default model's shape with random weights and simulated acceptance: off, fixed K, goodput
and schedule policies (sched0: K=0 with the drafter kept up), goodput's decisions traced."""
import gc, json, os, random, sys, time
from collections import Counter
import torch
from specserve.core.config import EngineConfig
from specserve.core.sampling_params import SamplingParams
from specserve.engine.engine import LLMEngine
import specserve.speculative.goodput_policy as gp

OUT = os.environ.get("OUT", "/tmp/out")
C = int(os.environ.get("C", "64")); N = int(os.environ.get("N", "1536"))
ALPHA = float(os.environ.get("ALPHA", "0.6"))
names = sys.argv[1].split(",")
base = dict(model=os.environ.get("SHAPE", "smollm2-135m"), load_format="dummy", device=os.environ.get("DEV", "cuda"), dtype="bfloat16" if os.environ.get("DEV", "cuda") == "cuda" else "float32",
            kv_cache_bytes=2 << 30, speculative_algorithm="eagle3",
            speculative_simulate_acceptance=ALPHA)
orig_marginal = gp.marginal_k

def patch(name):
    gp.marginal_k = orig_marginal
    if "dwell1" in name:  # a prefill step's K lasts one step: its switch there and back in full
        gp.marginal_k = lambda t, c, s, r, d: orig_marginal(t, c, s, r, 1)

def cfg(name):
    if name == "off":
        return dict(speculative_policy="off")
    if name.startswith("sched"):
        return dict(speculative_policy="schedule", speculative_schedule="1:" + name[5:])
    if name.startswith("fixed"):
        return dict(speculative_policy="fixed", speculative_num_steps=int(name[5:]))
    return dict(speculative_policy="goodput", speculative_num_steps=3)

rng = random.Random(0)
prompts = [[rng.randrange(100, 2000) for _ in range(rng.randint(30, 60))] for _ in range(N)]
lens = [rng.randint(150, 320) for _ in range(N)]

def closed_loop(engine, n, trace):
    i = 0; done = 0; toks = 0
    def send():
        nonlocal i
        engine.add_request(prompts[i % N], SamplingParams(max_tokens=lens[i % N], temperature=0.0, ignore_eos=True)); i += 1
    for _ in range(C):
        send()
    t0 = time.perf_counter(); s0 = engine.num_steps
    while done < n:
        for o in engine.step():
            if o.finished:
                done += 1; toks += len(o.token_ids)
                if i < n:
                    send()
    while engine.has_unfinished():
        engine.step()
    dt = time.perf_counter() - t0
    return dict(tok_s=toks / dt, seconds=dt, steps=engine.num_steps - s0, ms_step=dt * 1e3 / (engine.num_steps - s0))

res = {}
for name in names:
    patch(name)
    engine = LLMEngine(EngineConfig.from_flags(**base, **cfg(name)))
    pol = engine.spec.policy
    rows = []
    if "nodorm" in name:
        pol.DORMANT_AFTER = 10**9
    if name.startswith("goodput"):
        choose = pol.choose
        def wrapped(reqs, load, choose=choose, pol=pol, nodorm="nodorm" in name):
            if nodorm and load.after_idle:
                import dataclasses; load = dataclasses.replace(load, after_idle=False)
            d0 = pol.dormant; s0 = pol._settled is not None
            out = choose(reqs, load)
            dec = pol.trace.recent[-1] if pol.trace.recent else None
            rows.append((len(reqs), max(out, default=0), int(bool(dec and dec.probe)), int(d0), int(pol.dormant),
                         int(s0), int(load.prefill_tokens > 0), load.waiting, round(pol.surcharge.ms, 2)))
            return out
        pol.choose = wrapped
    gc.collect(); gc.freeze()
    closed_loop(engine, 2 * C, None)  # warm (shapes, start-up transients)
    rows.clear()
    loop = engine.loop; k0 = Counter(loop.kind_steps); m0 = Counter(loop.kind_ms)
    if os.environ.get("PROFILE"):
        import cProfile, pstats, io
        pr = cProfile.Profile(); pr.enable(); r = closed_loop(engine, N, rows); pr.disable()
        st_ = pstats.Stats(pr); prof = []
        for key, (cc, nc, tt, ct, callers) in st_.stats.items():
            prof.append((f"{key[0].split('/src/')[-1]}:{key[1]}:{key[2]}", nc, round(tt * 1e3 / r["steps"], 4), round(ct * 1e3 / r["steps"], 4)))
        prof.sort(key=lambda x: -x[2]); r["prof_tot"] = prof[:80]
        prof.sort(key=lambda x: -x[3]); r["prof_cum"] = prof[:150]
    else:
        r = closed_loop(engine, N, rows)
    ks = Counter(loop.kind_steps); ks.subtract(k0); km = Counter(loop.kind_ms); km.subtract(m0)
    r["kinds"] = {k: (v, round(km[k] / max(v, 1), 2)) for k, v in ks.items() if v}
    st = engine.stats()
    r["stats"] = {k: v for k, v in st.items() if k.startswith("spec_") or "host" in k}
    if rows:
        summ = Counter((p, k, pr, d) for (n, k, pr, d0, d, s, p, w, sc) in rows)
        r["decisions"] = {f"prefill={p} k={k} probe={pr} dormant={d}": v for (p, k, pr, d), v in sorted(summ.items())}
        r["trace"] = rows[-4000:]
        r["policy_trace"] = pol.trace.dump()
    res[name] = r
    print(name, {k: v for k, v in r["stats"].items() if "host" in k or "plain_ms" in k})
    print(name, json.dumps({k: v for k, v in r.items() if k not in ("trace", "policy_trace", "stats", "prof_tot", "prof_cum")}), flush=True)
    gc.unfreeze(); del engine, pol; gc.collect(); torch.cuda.empty_cache() if torch.cuda.is_available() else None
json.dump(res, open(f"{OUT}/cl_{C}.json", "w"), default=str)
for k, v in res.items():
    print(k, round(v["tok_s"]), round(v["ms_step"], 2), v["steps"])
