"""One-off (session 36): host parts a step, off against goodput held dormant, 64 chat requests
in a closed loop with turnover, in-process on CPU.  python probe/dormant_host.py MODEL_DIR off dormant off dormant
(MODEL_DIR: a config.json of SmolLM2's shape with fewer layers and its tokenizer, loaded as dummy)."""
import json, sys, time, os, itertools
import torch
torch.set_num_threads(2)
from specserve.llm import LLM
from specserve.core.sampling_params import SamplingParams
B = int(os.environ.get("B", "64")); STEPS = int(os.environ.get("STEPS", "200"))
qs = [json.loads(l)["messages"][-1]["content"] for l in open("src/specserve/data/everyday_questions.jsonl")]
for name in sys.argv[2:]:
    pol = "off" if name == "off" else "goodput"
    llm = LLM(sys.argv[1], load_format="dummy", speculative_algorithm="eagle3", speculative_policy=pol,
              kv_cache_bytes=2**30, max_num_seqs=B)
    eng = llm.engine
    if name == "dormant":
        p = eng.spec.policy
        p.cost.padded = True
        orig = p.choose
        def choose(reqs, load=None, _p=p, _o=orig):
            _p.dormant = True
            _p._settled = (10**9, 0, 1.0, {"tokens": [float(len(reqs))] * 4, "period_ms": [1.0] * 4, "switch_ms": [0.0] * 4})
            return _o(reqs, load) if load is not None else _o(reqs)
        p.choose = choose
    prompts = itertools.cycle([llm.apply_chat_template([{"role": "user", "content": q}]) for q in qs])
    lens = itertools.cycle([40, 90, 150, 230, 60, 120, 200, 30])
    for _ in range(B): eng.add_request(next(prompts), SamplingParams(max_tokens=next(lens), temperature=0.0, ignore_eos=True))
    for _ in range(20): eng.step()
    eng.loop.host_ms.clear(); n0 = eng.loop.num_steps; fin = 0
    import collections; acc = collections.Counter()
    def wrap(obj, attr):
        f = getattr(obj, attr)
        def g(*a, **k):
            t = time.perf_counter()
            try: return f(*a, **k)
            finally: acc[attr] += time.perf_counter() - t
        setattr(obj, attr, g)
    wrap(eng.scheduler, "_draft"); wrap(eng.spec, "observe"); wrap(eng.spec, "observe_period")
    wrap(eng.loop, "_schedule"); wrap(eng.loop, "_process"); wrap(eng.loop, "_resolve")
    wrap(eng.loop.sink, "output") if hasattr(eng.loop.sink, "output") else None
    while eng.loop.num_steps - n0 < STEPS:
        for o in eng.step():
            if o.finished:
                fin += 1; eng.add_request(next(prompts), SamplingParams(max_tokens=next(lens), temperature=0.0, ignore_eos=True))
    n = eng.loop.num_steps - n0
    print(name, "finished", fin, {k: round(v / n, 3) for k, v in sorted(eng.loop.host_ms.items())}, flush=True)
    print('   ', {k: round(v / n * 1e3, 4) for k, v in acc.items()})
    llm.close()
