"""Time the EAGLE-3 proposing step on the GPU (8B-shaped random target and head): the
engine's steps with fixed K=3 and simulated acceptance, each propose() synchronized and
timed, with the drafter's chain graphs, with per-pass graphs only, and eagerly.

    PYTHONPATH=src python scripts/diag_propose.py
    PYTHONPATH=src python scripts/diag_propose.py --tiny    # CPU smoke test (eager only)
"""

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine_bench import LLAMA_8B, random_head, random_model  # noqa: E402

from specserve.config import EngineConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def propose_ms(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Median and mean ms of the synchronized propose() calls while decoding."""
    proposer, times = engine.spec.proposer, []
    propose = proposer.propose

    def timed(items, *inflight):  # the overlap loop passes the step in flight too
        sync()
        t = time.perf_counter()
        propose(items, *inflight)
        sync()
        times.append((time.perf_counter() - t) * 1e3)

    g = torch.Generator().manual_seed(batch)
    for p in torch.randint(0, 32000, (batch, prompt_len), generator=g).tolist():
        engine.add_request(p, SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                             ignore_eos=True))  # fmt: skip
    while any(r.cached_len < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    proposer.propose = timed
    t = time.perf_counter()
    steps = engine.num_steps
    while engine.has_unfinished():
        engine.step()
    sync()
    seconds, steps = time.perf_counter() - t, engine.num_steps - steps
    del proposer.propose
    times = times[1:] or [0.0]  # the first one catches the prompt up (eager)
    return dict(batch=batch, propose_median_ms=round(statistics.median(times), 3),
                propose_mean_ms=round(statistics.mean(times), 3),
                ms_per_step=round(seconds / steps * 1e3, 3))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a small shape on the CPU (smoke test)")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    tiny = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                head_dim=16, num_layers=8)  # fmt: skip
    shape = replace(LLAMA_8B, **tiny) if args.tiny else LLAMA_8B
    model = random_model(shape, device)
    head = random_head(shape, Path(tempfile.mkdtemp()) / "head", 1000 if args.tiny else 32000)
    cfg = EngineConfig(device=device, dtype="bfloat16", max_num_seqs=64, cuda_graph_max_batch=64,
                       kv_cache_bytes=2**26 if args.tiny else 16 * 2**30, max_model_len=4096,
                       max_num_batched_tokens=4096, speculative_algorithm="eagle3",
                       speculative_draft_model_path=str(head), speculative_num_steps=3,
                       speculative_simulate_acceptance=3.0, speculative_policy="fixed")
    engine = LLMEngine(cfg, model=model)
    graphs = engine.spec.proposer.graphs
    modes = [("eager", None, ())]
    if graphs is not None:
        modes = [("chain graphs", graphs, graphs.chain_lengths),
                 ("per-pass graphs", graphs, ()), *modes]  # fmt: skip
    prompt_len, new_tokens = (16, 8) if args.tiny else (512, 96)
    for name, g, chains in modes:
        engine.spec.proposer.graphs = g
        if g is not None:
            g.chain_lengths = chains
        for batch in (1, 64):
            print(name, propose_ms(engine, batch, prompt_len, new_tokens), flush=True)


if __name__ == "__main__":
    main()
