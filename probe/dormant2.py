"""One-off probe: the engine's host time per step, off against goodput dormant (py-spy)."""
import collections, gc, os, subprocess, sys, tempfile, threading, time
from dataclasses import replace
from pathlib import Path
import torch
sys.path.insert(0, "benchmarks")
from gpu_engine import LLAMA_8B, random_head, random_model, run
from specserve.core.config import EngineConfig
from specserve.core.sampling_params import SamplingParams
from specserve.engine.engine import LLMEngine

shape = replace(LLAMA_8B, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True, rope_theta=100000.0)
model = random_model(shape, "cuda")
head = random_head(shape, Path(tempfile.mkdtemp()) / "head")
base = dict(device="cuda", dtype="bfloat16", max_num_seqs=64, cuda_graph_max_batch=64,
            kv_cache_bytes=4 * 2**30, max_num_batched_tokens=2048, max_model_len=4096)
spec = dict(speculative_algorithm="eagle3", speculative_draft_model_path=str(head), speculative_num_steps=3)
configs = {
    "off": {**spec, "speculative_policy": "off"},
    "goodput-dormant": {**spec, "speculative_policy": "goodput", "speculative_simulate_acceptance": 0.02},
}
out = os.environ.get("OUT", "/tmp")
for name, extra in configs.items():
    engine = LLMEngine(EngineConfig.from_flags(**base, **extra), model=model)
    gc.collect(); gc.freeze()
    run(engine, 64, 48, 24)
    run(engine, 64, 48, 256)
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    for i in range(64):
        engine.add_request(list(range(100 + i, 148 + i)), params)
    for _ in range(200):
        engine.step()
    raw = f"{out}/{name}.raw"
    p = subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), "-d", "2", "-r", "1000", "-f", "raw", "-o", raw, "--nonblocking"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    n0, t0 = engine.num_steps, time.perf_counter()
    while p.poll() is None:
        engine.step()
    steps, secs = engine.num_steps - n0, time.perf_counter() - t0
    print(f"== {name}: {steps} steps in {secs:.1f}s: {1000*secs/steps:.3f} ms/step", flush=True)
    incl, total = collections.Counter(), 0
    for line in open(raw):
        stack, _, cnt = line.rstrip().rpartition(" ")
        cnt = int(cnt); total += cnt
        seen = set()
        for fr in stack.split(";"):
            key = fr.split(" (")[0] + " " + fr.split("/")[-1].split(":")[0] if "(" in fr else fr
            if "specserve" in fr and key not in seen:
                seen.add(key); incl[key] += cnt
    for key, c in incl.most_common(40):
        print(f"   {1000*secs/steps*c/total:7.3f} ms/step {100*c/total:5.1f}%  {key[:110]}")
    engine.abort_all() if hasattr(engine, "abort_all") else None
    gc.unfreeze(); del engine; gc.collect(); torch.cuda.empty_cache()
