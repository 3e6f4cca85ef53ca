"""One-off (session 36, issue 32): the 8B shape under a JSON schema at fixed K=3, 64 rows, in-process:
where the sample part goes.  MODEL=<folder: the 8B config with SmolLM2's tokenizer> python probe/schema_step.py"""
import json, sys, time, os, itertools, cProfile, pstats, statistics, io
import torch
from specserve.llm import LLM
from specserve.core.sampling_params import SamplingParams, Grammar
B = int(os.environ.get("B", "64")); STEPS = int(os.environ.get("STEPS", "60"))
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "notes": {"type": "array", "items": {"type": "string"}, "minItems": 1}}, "required": ["title", "notes"]}
qs = [json.loads(l)["messages"][-1]["content"] for l in open("src/specserve/data/everyday_questions.jsonl")]
t0 = time.time()
llm = LLM(os.environ["MODEL"], load_format="dummy", speculative_algorithm="eagle3", speculative_policy="fixed",
          speculative_simulate_acceptance=3.0, max_num_seqs=B)
print("built", round(time.time() - t0, 1), flush=True)
eng = llm.engine; loop = eng.loop
prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in qs]
def run(kind, prof=None):
    g = Grammar("json_schema", json.dumps(SCHEMA)) if kind == "schema" else None
    params = SamplingParams(max_tokens=100000 if g is None else 2000, temperature=0.0, grammar=g, ignore_eos=True)
    for i in range(B): eng.add_request(prompts[i % len(prompts)], params)
    for _ in range(25): eng.step()
    loop.host_ms.clear(); t = loop.times
    for q in (t.step_ms, t.gap_ms, t.wait_ms): q.clear()
    n0 = loop.num_steps; w0 = dict(loop.wait_reasons); hw0 = loop.totals["host_wait_ms"]
    if prof: 
        orig = loop.runner.sample_async
        def sa(*a, **k):
            prof.enable()
            try: return orig(*a, **k)
            finally: prof.disable()
        loop.runner.sample_async = sa
    ts = time.perf_counter()
    for _ in range(STEPS): eng.step()
    el = (time.perf_counter() - ts) * 1e3
    if prof: loop.runner.sample_async = orig
    n = loop.num_steps - n0
    print(f"{kind}{' (profiled)' if prof else ''}: wall/step {el / n:.2f} ms, device span {statistics.mean(t.step_ms) if t.step_ms else 0:.2f}, gap {statistics.mean(t.gap_ms) if t.gap_ms else 0:.2f}, host wait {statistics.mean(t.wait_ms) if t.wait_ms else 0:.2f}",
          {k: round(v / n, 3) for k, v in sorted(loop.host_ms.items())}, "waits", {k: v - w0.get(k, 0) for k, v in loop.wait_reasons.items() if v - w0.get(k, 0)}, flush=True)
    for rid in list(eng.requests): eng.abort_request(rid)
    while eng.has_unfinished(): eng.step()
run("free"); run("schema"); run("free"); run("schema")
prof = cProfile.Profile(); run("schema", prof)
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(28); print(s.getvalue()[-6000:])
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30); print(s.getvalue()[-6000:])
