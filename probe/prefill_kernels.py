"""One-off probe: kernels of a 64-token prefill step against a 64-row decode step, 8B shape."""
import sys, random, torch
from torch.profiler import profile, ProfilerActivity
from specserve import LLM, SamplingParams
llm = LLM("llama-3.1-8b", load_format="dummy", speculative_algorithm="none", kv_cache_bytes=8 << 30)
eng = llm.engine
rng = random.Random(0)
def rnd(n): return [rng.randrange(100, 30000) for _ in range(n)]
def run(prompt, n):
    eng.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    torch.cuda.synchronize()
def show(tag, p, steps=1):
    rows = [(e.key, e.count, e.device_time_total) for e in p.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    tot = sum(r[2] for r in rows)
    print(f"===== {tag}: {tot/1e3/steps:.2f} ms a step")
    for k, c, t in rows[:14]:
        print(f"  {k[:60]:60s} {c/steps:6.1f} {t/1e3/steps:7.3f} ms {t/max(c,1):7.1f} us")
for _ in range(3):
    run(rnd(64), 4)
for tag, plen in [("prefill64", 64), ("prefill256", 256), ("prefill32", 32)]:
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        run(rnd(plen), 1)
    show(tag, p)
# 64 requests decoding: profile 8 steps
for i in range(64):
    eng.add_request(rnd(16), SamplingParams(max_tokens=40, ignore_eos=True))
for _ in range(6):
    eng.step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as p:
    for _ in range(8):
        eng.step()
    torch.cuda.synchronize()
show("decode64", p, 8)
while eng.has_unfinished():
    eng.step()
# same with one request arriving: mixed step 64 decode + 64 prefill
for i in range(64):
    eng.add_request(rnd(16), SamplingParams(max_tokens=40, ignore_eos=True))
for _ in range(6):
    eng.step()
torch.cuda.synchronize()
eng.add_request(rnd(64), SamplingParams(max_tokens=4, ignore_eos=True))
with profile(activities=[ProfilerActivity.CUDA]) as p:
    eng.step()
    torch.cuda.synchronize()
show("mixed 64 decode + 64 prefill (one step)", p)
