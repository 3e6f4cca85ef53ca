"""GPU benchmark of overlap scheduling: the device's idle gap between steps with the overlap
loop on and off, side by side in one run.

Models: the embedded SmolLM2-135M (GGUF) and a random-weight Llama-3.1-8B-shaped bf16 model,
plain decoding at batch 1 and 64; plus the 8B shape with a random EAGLE-3 head, simulated
acceptance (mean accept length 3.0) and fixed K=3. One engine per model configuration; the
loop is switched between runs (`engine.loop.overlap`), so both loops run the same graphs
and kernels. Per run: output tokens/s, mean wall time per step, mean device span of a step
and mean device idle gap between consecutive steps (CUDA events at the start and end of
each step's device work), and the gap as a share of the step period (span + gap). Decoding
only: prefill steps run first and are not timed. Writes JSON and a markdown table.

    PYTHONPATH=src python benchmarks/gpu_overlap.py --out $OUT/overlap
    PYTHONPATH=src python benchmarks/gpu_overlap.py --smoke --out /tmp/overlap  # CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine import LLAMA_8B, random_head, random_model  # noqa: E402

from specserve.core.config import EngineConfig  # noqa: E402
from specserve.core.sampling_params import SamplingParams  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_layers=8,
    vocab_size=512,
)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def run(engine: LLMEngine, overlap: bool, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """One decode run of `batch` requests under the chosen loop."""
    assert engine.loop.inflight is None and not engine.has_unfinished()
    engine.loop.overlap = overlap
    gen = torch.Generator().manual_seed(batch)
    vocab = min(engine.model_config.vocab_size, 32000)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while any(r.cached_len < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()  # prefill, not timed
    engine.loop.drain()  # nor the last prefill step, in flight under overlap
    sync()
    steps0 = engine.num_steps
    produced = sum(r.num_generated for r in engine.requests.values())
    engine.loop.times.clear()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync()
    seconds = time.perf_counter() - t0
    steps = engine.num_steps - steps0
    tokens = batch * new_tokens - produced
    times = engine.loop.times
    span, gap = mean(times.step_ms), mean(times.gap_ms)
    row = {
        "batch": batch,
        "overlap": overlap,
        "decode_tokens": tokens,
        "steps": steps,
        "output_tok_s": round(tokens / seconds, 1),
        "ms_per_step": round(seconds / steps * 1e3, 3),
        "gpu_step_ms": round(span, 3) if span is not None else None,
        "gpu_gap_ms": round(gap, 4) if gap is not None else None,
        "gap_pct": round(100 * gap / (span + gap), 2) if span and gap is not None else None,
    }
    assert engine.kv.allocator.num_used == 0
    return row


def bench(name: str, engine: LLMEngine, args) -> list[dict]:
    for b in args.batches:  # warm-up: Triton compiles each new shape on first use
        for overlap in (False, True):
            run(engine, overlap, b, args.warmup_prompt_len, args.warmup_tokens)
    rows = []
    for b in args.batches:
        for overlap in (False, True):
            row = {"config": name, **run(engine, overlap, b, args.prompt_len, args.new_tokens)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="overlap")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny random models on the CPU, a few tokens (checks the script)",
    )
    args = ap.parse_args()
    args.warmup_prompt_len, args.warmup_tokens = 64, 24
    if args.smoke:
        args.prompt_len, args.new_tokens, args.batches = 16, 6, [1, 4]
        args.warmup_prompt_len, args.warmup_tokens = 8, 3
    device = "cpu" if args.smoke else "cuda"
    start = time.perf_counter()
    base = dict(
        device=device,
        max_num_seqs=max(args.batches),
        cuda_graph_max_batch=max(args.batches),
        max_num_batched_tokens=4096,
        max_model_len=2048,
        overlap_schedule="on",
    )
    results: dict[str, dict] = {}

    def record(name: str, engine: LLMEngine, t0: float) -> None:
        startup = time.perf_counter() - t0
        rows = bench(name, engine, args)
        results[name] = {"startup_s": round(startup, 2), "rows": rows}

    # 1. The small model: the host's share of a step is largest here.
    t0 = time.perf_counter()
    shape = replace(LLAMA_8B, **TINY) if args.smoke else LLAMA_8B
    if args.smoke:
        small = LLMEngine(
            EngineConfig.from_flags(
                **base, dtype="float32", speculative_algorithm="none", kv_cache_bytes=2**24
            ),
            model=random_model(replace(shape, num_layers=2), device),
        )
        small_name = "tiny 2-layer (smoke)"
    else:
        small = LLMEngine(
            EngineConfig.from_flags(
                model=None, speculative_algorithm=None, kv_cache_bytes=4 * 2**30, **base
            )
        )
        small_name = "SmolLM2-135M"
    record(small_name, small, t0)
    del small
    # 2. The 8B shape, plain and speculative (random weights on the device).
    model = random_model(shape, device)
    kv_bytes = 2**25 if args.smoke else 16 * 2**30
    big = "8B shape (tiny, smoke)" if args.smoke else "Llama-3.1-8B shape"
    t0 = time.perf_counter()
    engine = LLMEngine(
        EngineConfig.from_flags(
            **base, dtype="bfloat16", speculative_algorithm="none", kv_cache_bytes=kv_bytes
        ),
        model=model,
    )
    record(big, engine, t0)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    head = random_head(
        shape, Path(tempfile.mkdtemp()) / "head", draft_vocab=256 if args.smoke else 32000
    )
    t0 = time.perf_counter()
    engine = LLMEngine(
        EngineConfig.from_flags(
            **base,
            dtype="bfloat16",
            kv_cache_bytes=kv_bytes,
            speculative_algorithm="eagle3",
            speculative_draft_model_path=str(head),
            speculative_num_steps=3,
            speculative_policy="fixed",
            speculative_simulate_acceptance=3.0,
        ),
        model=model,
    )
    record(f"{big} + EAGLE-3 K=3 (sim. accept len 3.0)", engine, t0)
    results["total_s"] = round(time.perf_counter() - start, 1)
    results["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"

    lines = [
        "| config | batch | loop | tok/s | ms/step | device ms/step | idle gap ms | gap % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        if not isinstance(res, dict):
            continue
        for r in res["rows"]:
            loop = "overlap" if r["overlap"] else "sync"
            lines.append(
                f"| {name} | {r['batch']} | {loop} | {r['output_tok_s']} | {r['ms_per_step']} "
                f"| {r['gpu_step_ms']} | {r['gpu_gap_ms']} | {r['gap_pct']} |"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"total {results['total_s']} s", flush=True)


if __name__ == "__main__":
    main()
