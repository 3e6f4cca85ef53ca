"""One-off probe: the default model on chat prompts, closed loop in the engine (no HTTP):
off, goodput, goodput held dormant, fixed K=3; interleaved repeats."""
import gc, json, os, statistics, sys, time
import torch
from specserve.llm import LLM
from specserve.core.sampling_params import SamplingParams

OUT = os.environ.get("OUT", "/tmp")
base = dict(kv_cache_bytes=2 * 2**30, max_num_seqs=64)
cfgs = {
    "off": dict(speculative_policy="off"),
    "goodput": dict(speculative_policy="goodput"),
    "dormant": dict(speculative_policy="goodput"),
    "fixed": dict(speculative_policy="fixed"),
    "noprobe": dict(speculative_policy="goodput"),
    "nofav": dict(speculative_policy="goodput"),
}
if os.environ.get("ONLY"):
    cfgs = {k: cfgs[k] for k in os.environ["ONLY"].split(",")}
convs = [json.loads(l)["messages"] for l in open("src/specserve/data/everyday_questions.jsonl") if l.strip()]
llms = {}
for name, extra in cfgs.items():
    llm = LLM(**base, **extra)
    pol = llm.engine.spec.policy
    if name == "dormant":
        orig = pol.choose
        def choose(reqs, load=None, _p=pol, _o=orig):
            _p.dormant = True
            _p._settled = (10**9, 1.0, {})
            return _o(reqs, load) if load is not None else _o(reqs)
        pol.choose = choose
    if name == "noprobe":
        pol._probe_k = lambda *a: (a[1], False)
    if name == "nofav":
        pol.modes.favors_drafting = lambda *a: False
    llms[name] = llm
    print(name, "built", flush=True)
prompts = [next(iter(llms.values())).apply_chat_template(c) for c in convs]
gc.collect(); gc.freeze()
params = SamplingParams(max_tokens=int(os.environ.get("MAXTOK", "256")), temperature=0.0)
KEYS = ("spec_steps_by_step_k", "spec_probe_steps", "spec_switches", "spec_dormant_steps", "spec_wakes",
        "spec_drafting_held", "spec_plain_overruled", "spec_drafter_eager_passes", "spec_drafter_eager_tokens",
        "spec_plain_ms_by_part", "spec_plain_steps_by_part", "spec_period_ms_by_step_k", "device_step_ms", "device_gap_ms")

def closed_loop(llm, c, n):
    eng = llm.engine
    before = {k: v for k, v in eng.stats().items() if k in KEYS}
    nxt, done, toks, inflight = 0, 0, 0, 0
    steps0 = eng.loop.num_steps
    t0 = time.perf_counter()
    while done < n:
        while inflight < c and nxt < n:
            eng.add_request(prompts[nxt % len(prompts)], params); nxt += 1; inflight += 1
        for o in eng.step():
            toks += o.num_new_tokens
            if o.finished:
                done += 1; inflight -= 1
    el = time.perf_counter() - t0
    after = {k: v for k, v in eng.stats().items() if k in KEYS}
    return dict(tok_s=toks / el, steps=eng.loop.num_steps - steps0, secs=el, toks=toks, before=before, after=after)

rows = []
seq = [int(x) for x in os.environ.get("CONC", "16,64,16,64").split(",")]
for rep, c in enumerate(seq):
    for name, llm in llms.items():
        r = closed_loop(llm, c, int(os.environ.get("PER", "16")) * c)
        rows.append(dict(name=name, c=c, rep=rep, **r))
        a, b = r["after"], r["before"]
        d = {k: (a[k] - b[k]) if isinstance(a.get(k), (int, float)) else a.get(k) for k in a}
        print(f"rep {rep} c {c:3d} {name:8s} {r['tok_s']:9.0f} tok/s  steps {r['steps']:6d}  {r['secs']:.2f}s  "
              f"probe {d.get('spec_probe_steps')} sw {d.get('spec_switches')} dormant {d.get('spec_dormant_steps')} "
              f"held {d.get('spec_drafting_held')} fav {d.get('spec_plain_overruled')} eager {d.get('spec_drafter_eager_passes')}/{d.get('spec_drafter_eager_tokens')} "
              f"dev {d.get('device_step_ms', 0):.0f} gap {d.get('device_gap_ms', 0):.0f}", flush=True)
        if name in ("goodput", "noprobe", "nofav"):
            print("    wakes", a.get("spec_wakes"), "byK", a.get("spec_steps_by_step_k"), "plain", a.get("spec_plain_ms_by_part"), a.get("spec_plain_steps_by_part"), "periodK", a.get("spec_period_ms_by_step_k"), flush=True)
for c in sorted(set(seq)):
    for name in llms:
        v = [r["tok_s"] for r in rows if r["c"] == c and r["name"] == name]
        print(f"SUMMARY c {c:3d} {name:8s} median {statistics.median(v):9.0f}  all {[round(x) for x in v]}")
json.dump(rows, open(f"{OUT}/e2.json", "w"), indent=1, default=str)
