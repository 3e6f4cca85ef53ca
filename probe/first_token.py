"""One-off probe: first-token time with mixed graphs' GEMVs by row count (PATCH=1) or not."""
import os, sys, time, random, torch
if os.environ.get("PATCH") == "1":
    from specserve.model import llama
    orig = llama.LlamaForCausalLM.forward
    def forward(self, input_ids, meta, *a, **k):
        out = orig(self, input_ids, meta, *a, **k)
        return out
    # set step_requests None for mixed metas: wrap the plan's attribute set
    def patched(self, input_ids, meta, kv_cache, backend, aux_layer_ids=()):
        r = orig(self, input_ids, meta, kv_cache, backend, aux_layer_ids)
        return r
    import specserve.kernels.gemv_plan as gp
    ocf = gp.GemvPlan.config_for
    state = {"mixed": False}
    def cf(self, rows, n, k, dtype, fusion=None):
        if state["mixed"]:
            saved, self.step_requests = self.step_requests, None
            try:
                return ocf(self, rows, n, k, dtype, fusion)
            finally:
                self.step_requests = saved
        return ocf(self, rows, n, k, dtype, fusion)
    gp.GemvPlan.config_for = cf
    def fwd(self, input_ids, meta, kv_cache, backend, aux_layer_ids=()):
        state["mixed"] = meta.mixed is not None
        try:
            return orig(self, input_ids, meta, kv_cache, backend, aux_layer_ids)
        finally:
            state["mixed"] = False
    llama.LlamaForCausalLM.forward = fwd
from specserve import LLM, SamplingParams
llm = LLM("llama-3.1-8b", load_format="dummy", speculative_algorithm="none", kv_cache_bytes=8 << 30)
eng, loop = llm.engine, llm.engine.loop
rng = random.Random(0)
def rnd(n): return [rng.randrange(100, 30000) for _ in range(n)]
prefix = rnd(2048)
def first(prompt, max_tokens=4):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    f = None
    while eng.has_unfinished():
        if eng.step() and f is None:
            f = (time.perf_counter() - t0) * 1e3
    return f
res = {}
for rep in range(4):
    for tag, mk in [("q16", lambda: rnd(16)), ("q40", lambda: rnd(40)), ("q64", lambda: rnd(64)),
                    ("cached64", lambda: prefix + rnd(64)), ("q2112", lambda: rnd(2112))]:
        res.setdefault(tag, []).append(first(mk()))
print("PATCH", os.environ.get("PATCH"), {k: [round(x, 2) for x in v[1:]] for k, v in res.items()})
# steady decode at 64 with arrivals of 48-token prompts: throughput
def load(n_req=256, conc=64, plen=48, out=64):
    t0 = time.perf_counter(); done = 0; toks = 0; pending = n_req
    active = 0
    while pending or eng.has_unfinished():
        while pending and active < conc:
            eng.add_request(rnd(plen), SamplingParams(max_tokens=out, ignore_eos=True)); pending -= 1; active += 1
        for o in eng.step():
            if o.finished:
                active -= 1; toks += len(o.token_ids)
    return toks / (time.perf_counter() - t0)
load(64)
print("PATCH", os.environ.get("PATCH"), "closed loop c64 tok/s", [round(load()) for _ in range(2)],
      "c8", [round(load(64, 8)) for _ in range(2)])
