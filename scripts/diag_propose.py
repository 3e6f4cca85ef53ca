"""Profile the EAGLE-3 proposer on the GPU (8B-shaped random target and head)."""
import sys
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "scripts")
from gpu_engine_bench import LLAMA_8B, random_head, random_model  # noqa: E402

from specserve.config import EngineConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402

model = random_model(LLAMA_8B, "cuda")
head = random_head(LLAMA_8B, Path(tempfile.mkdtemp()) / "head")
cfg = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, cuda_graph_max_batch=8,
                   kv_cache_bytes=4 * 2**30, max_model_len=4096,
                   speculative_algorithm="eagle3", speculative_draft_model_path=str(head),
                   speculative_num_steps=3, speculative_simulate_acceptance=3.0,
                   speculative_policy="fixed")
engine = LLMEngine(cfg, model=model)
engine.add_request(list(range(100, 612)), SamplingParams(max_tokens=400, ignore_eos=True,
                                                         temperature=0.0))
for _ in range(30):
    engine.step()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        engine.step()
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
