import random, sys, time, json, collections
from specserve import LLM, SamplingParams
C = int(sys.argv[1]); ACC = float(sys.argv[2]); STEPS = int(sys.argv[3])
llm = LLM(model="smollm2-135m", load_format="dummy", kv_cache_bytes=2 << 30, speculative_algorithm="eagle3",
          speculative_policy="goodput", speculative_num_steps=3, speculative_simulate_acceptance=ACC)
eng = llm.engine; spec = eng.spec; pol = spec.policy; rng = random.Random(0)
def add():
    p = SamplingParams(max_tokens=rng.randrange(160, 352), temperature=0.0, ignore_eos=True)
    eng.add_request([rng.randrange(100, 40000) for _ in range(rng.randrange(24, 72))], p)
for _ in range(C): add()
print("seeds", {f"{n}:{k}": round(spec.cost.seed_ms(n, k), 3) for n in (16, 32, 64) for k in range(4)})
t = time.perf_counter(); last = 0
for i in range(1, STEPS + 1):
    for o in eng.step():
        if o.finished: add()
    if i % 300 == 0:
        now = time.perf_counter(); ms = (now - t) * 1e3 / 300; t = now
        dec = list(pol.trace.recent)[-300:]
        mix = collections.Counter(d.k for d in dec)
        snap = spec.cost.snapshot()
        cells = {k: v for k, v in snap.items() if k.startswith("32:") or k.startswith("16:")}
        modes = {m: pol.modes.rate(32, m) for m in ("plain", "drafting")}
        mc = {f"{b}:{m}": (round(c.tokens, 3), round(c.expected_tokens, 3), round(c.ms, 3), round(c.expected_ms, 3), c.steps) for (b, m), c in pol.modes._cells.items()}
        exp = pol.trace.expectations()
        print(f"step {i} period {ms:.3f} mix {dict(mix)} dormant {pol.dormant} upkeep {pol.upkeep.ms:.3f} surcharge {pol.surcharge.ms:.3f} share {pol.prefill_runs.share:.3f} wakes {pol.trace.wakes} held {pol.modes.num_held} favored {pol.modes.num_favored}")
        print("  cells", json.dumps(cells))
        print("  modes", modes, mc)
        print("  expected", {k: round(v, 3) for k, v in exp["expected_tokens"].items() if k.startswith("32")}, {k: round(v, 3) for k, v in exp["expected_period_ms"].items() if k.startswith("32")})
        po = [(d.k, d.parts, round(d.observed_ms or 0, 2), d.held, d.probe) for d in dec[-12:]]
        print("  last", po, flush=True)
