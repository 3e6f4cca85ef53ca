"""One-off probe: the default model's plain step, off against goodput held dormant (engine)."""
import gc, json, os, statistics, sys, time
import torch
sys.path.insert(0, "benchmarks")
from bench_report import tuning_reports
from specserve.llm import LLM
from specserve.core.sampling_params import SamplingParams

OUT = os.environ.get("OUT", "/tmp")
base = dict(kv_cache_bytes=2 * 2**30, max_num_seqs=64)
cfgs = {
    "off": dict(speculative_policy="off"),
    "dormant": dict(speculative_policy="goodput"),
    "off-nt": dict(speculative_policy="off", disable_gemv_tuning=True),
    "dormant-nt": dict(speculative_policy="goodput", disable_gemv_tuning=True),
    "none": dict(speculative_algorithm="none"),
}
if os.environ.get("ONLY"):
    cfgs = {k: cfgs[k] for k in os.environ["ONLY"].split(",")}
llms, report = {}, {}
for name, extra in cfgs.items():
    t0 = time.perf_counter()
    llm = LLM(**base, **extra)
    eng = llm.engine
    pol = eng.spec.policy if eng.spec else None
    if name.startswith("dormant"):
        orig = pol.choose
        def choose(reqs, load=None, _p=pol, _o=orig):
            _p.dormant = True
            _p._settled = (10**9, 1.0, {})
            return _o(reqs, load) if load is not None else _o(reqs)
        pol.choose = choose
    llms[name] = llm
    report[name] = {"build_s": time.perf_counter() - t0, "tuning": tuning_reports(eng)}
    print(name, "built", round(time.perf_counter() - t0, 1), "s", flush=True)
gc.collect(); gc.freeze()

def replay_ms(eng, b):
    g = eng.runner.graphs
    key = (g.bucket_for(b), 1)
    graph = g._graphs[key][0]
    for _ in range(20): graph.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(300): graph.replay()
    e.record(); e.synchronize()
    return s.elapsed_time(e) / 300

for name, llm in llms.items() if torch.cuda.is_available() else ():
    report[name]["replay_ms"] = {b: replay_ms(llm.engine, b) for b in (1, 16, 64)}
    print(name, "replay", report[name]["replay_ms"], flush=True)

params = SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True)
def run(llm, b, steps):
    eng = llm.engine
    for i in range(b):
        eng.add_request(list(range(100 + i, 140 + i)), params)
    for _ in range(60): eng.step()
    times = eng.loop.times
    times.step_ms.clear(); times.gap_ms.clear(); n0 = g0 = 0
    t0 = time.perf_counter()
    for _ in range(steps): eng.step()
    el = time.perf_counter() - t0
    dev = list(times.step_ms)[n0:]; gap = list(times.gap_ms)[g0:]
    for rid in list(eng.requests): eng.abort_request(rid)
    while eng.has_unfinished(): eng.step()
    return dict(ms=el / steps * 1e3, dev=statistics.median(dev) if dev else None,
                gap=statistics.median(gap) if gap else None)

rows = []
for rep in range(int(os.environ.get("REPS", "3"))):
    for b in (16, 64):
        for name, llm in llms.items():
            r = run(llm, b, int(os.environ.get('STEPS', '800')))
            rows.append(dict(name=name, b=b, rep=rep, **r))
            print(f"rep {rep} b {b:3d} {name:11s} {r['ms']:.3f} ms/step  device {r['dev']}  gap {r['gap']}", flush=True)
report["rows"] = rows
for b in (16, 64):
    for name in llms:
        ms = [r["ms"] for r in rows if r["b"] == b and r["name"] == name]
        dv = [r["dev"] for r in rows if r["b"] == b and r["name"] == name]
        print(f"SUMMARY b {b:3d} {name:11s} ms/step median {statistics.median(ms):.3f}  device {statistics.median(dv) if None not in dv else None}")
json.dump(report, open(f"{OUT}/e1.json", "w"), indent=1, default=str)
