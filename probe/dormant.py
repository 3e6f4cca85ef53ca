"""One-off probe: why plain steps with the goodput policy dormant cost more than the off
policy's on the default model's shape (batch 64 decode), by kernel."""
import gc, json, sys, tempfile, time
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
    "none": {"speculative_algorithm": "none"},
    "off": {**spec, "speculative_policy": "off"},
    "goodput-dormant": {**spec, "speculative_policy": "goodput", "speculative_simulate_acceptance": 0.02},
    "off-again": {**spec, "speculative_policy": "off"},
}
for name, extra in configs.items():
    engine = LLMEngine(EngineConfig.from_flags(**base, **extra), model=model)
    gc.collect(); gc.freeze()
    run(engine, 64, 48, 24)
    r = run(engine, 64, 48, 768)
    st = engine.stats()
    # profile a stretch of decode steps
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(64):
        engine.add_request(list(range(100 + i, 148 + i)), params)
    for _ in range(150):
        engine.step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(40):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    ev = [e for e in prof.key_averages() if e.device_time_total > 0]
    ev.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in ev)
    print(f"== {name}: tok/s {r.get('output_tok_s')} full {r.get('full_batch_tok_s')} dormant {getattr(engine.spec.policy, 'dormant', None) if engine.spec else None}")
    print("   spec", {k: v for k, v in st.items() if k in ('spec_dormant_steps', 'spec_probe_steps', 'spec_steps_by_draft_len')})
    print(f"   device total per step {total/40/1000:.3f} ms over {len(ev)} kernel kinds")
    for e in ev[:25]:
        print(f"   {e.device_time_total/40:9.1f} us/step  {e.count/40:6.1f}/step  {e.key[:90]}")
    cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    for e in cpu:
        print(f"   cpu {e.self_cpu_time_total/40:9.1f} us/step {e.count/40:6.1f}/step {e.key[:80]}")
    gc.unfreeze(); del engine; gc.collect(); torch.cuda.empty_cache()
