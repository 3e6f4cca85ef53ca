"""Per launched step: kind, K, host parts of its launch, its device span, and the period of
the step processed when it was launched (which holds its launch under overlap)."""
import random, sys, time, statistics as st, collections
from specserve import LLM, SamplingParams
C = int(sys.argv[1]); ACC = float(sys.argv[2]); STEPS = int(sys.argv[3])
out = {}
for mode in sys.argv[4].split(","):
    kw = dict(speculative_algorithm="eagle3", speculative_num_steps=3, speculative_simulate_acceptance=ACC,
              speculative_policy={"fixed": "fixed", "dormant": "goodput", "off": "off"}[mode])
    llm = LLM(model="smollm2-135m", load_format="dummy", kv_cache_bytes=2 << 30, **kw)
    eng = llm.engine; loop = eng.loop; rng = random.Random(0)
    if mode == "dormant":  # every decision plain, the drafter asleep
        pol = eng.spec.policy
        pol.choose = (lambda f: (lambda reqs, load=None: (setattr(pol, "dormant", True), [0] * len(reqs))[1]))(pol.choose)
        pol.dormant = True
    recs = []
    orig = loop._launch
    def launch(prev, batch, drafting, keeps, late, waited=False, orig=orig):
        t = time.perf_counter(); st_ = orig(prev, batch, drafting, keeps, late, waited)
        if st_ is not None:
            recs.append((st_, (time.perf_counter() - t) * 1e3))
        return st_
    loop._launch = launch
    def add():
        p = SamplingParams(max_tokens=rng.randrange(160, 352), temperature=0.0, ignore_eos=True)
        eng.add_request([rng.randrange(100, 40000) for _ in range(rng.randrange(24, 72))], p)
    for _ in range(C): add()
    for i in range(STEPS):
        for o in eng.step():
            if o.finished: add()
    recs = recs[int(__import__("os").environ.get("SKIP", 300)):-2]
    rows = []
    for j in range(1, len(recs)):
        s, launch_ms = recs[j]
        prev = recs[j - 1][0]
        period = (prev.resolved_s - recs[j - 2][0].resolved_s) * 1e3 if j >= 2 else None
        pf = any(not x.decoding for x in s.batch)
        k = max((x.draft_len for x in s.batch if x.decoding), default=0)
        rows.append((pf, k, launch_ms, s.draft_ms, s.host_ms, s.upkeep_ms or 0.0, s.device_ms or 0.0, period))
    g = collections.defaultdict(list)
    for r in rows:
        g[("prefill" if r[0] else "decode", r[1])].append(r)
    print(f"== {mode} C={C} acc={ACC}: steps {len(rows)}")
    for key, rs in sorted(g.items()):
        med = lambda i: st.median([r[i] for r in rs if r[i] is not None])
        print(f"  {key}: n={len(rs)} launch {med(2):.3f} (draft {med(3):.3f} prepare+fwd+sample {med(4):.3f} upkeep {med(5):.3f}) device {med(6):.3f} | period of the step before (holds this launch) {med(7):.3f}", flush=True)
    llm.close() if hasattr(llm, "close") else None
    del llm, eng, loop
