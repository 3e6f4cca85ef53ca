"""GPU benchmark of the whole engine (scheduler, Triton attention, CUDA graphs, sampler,
speculation) on a random-weight Llama-3.1-8B-shaped bf16 model built on the GPU.

Side by side in one run: plain decode at batch 1 and 64; EAGLE-3-shaped random head with
simulated acceptance (mean acceptance length 3.0 at K=3) under the fixed and goodput
policies; 512-token prompts, 256 output tokens (ignore_eos). Writes JSON and markdown: decode
tok/s over the whole run and while every request of the batch decodes (until the first ends:
under chunked prefill the first prompts start decoding a few steps early, so they end early
and a run's last steps decode fewer requests).

    python benchmarks/gpu_engine.py --out $OUT/gpu_engine
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from specserve.core.config import EngineConfig
from specserve.core.model_config import ModelConfig
from specserve.core.sampling_params import SamplingParams
from specserve.engine.engine import LLMEngine
from specserve.model.eagle3 import Eagle3Config, Eagle3Head, save_eagle3_head
from specserve.model.llama import LlamaForCausalLM
from specserve.speculative.cost_curves import memory_bandwidth

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_engines import AB_VARIANTS, force_plan  # noqa: E402
from bench_report import GC_PAUSES, combine, table, tuning_reports  # noqa: E402

LLAMA_8B = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    dtype=torch.bfloat16,
    eos_token_ids=(),
)


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus written), the best of ten
    copies: lent H200s differ by a few percent, and this says which kind a run had."""
    return memory_bandwidth(torch.device("cuda"), num_bytes) * 1e3


@torch.no_grad()
def random_model(cfg: ModelConfig, device) -> LlamaForCausalLM:
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0, 0.02)
    model.rotary.materialize(torch.device(device))
    return model.eval()


@torch.no_grad()
def random_head(cfg: ModelConfig, folder: Path, draft_vocab: int = 32000) -> Path:
    head_cfg = Eagle3Config.for_target(cfg, draft_vocab)
    head = Eagle3Head(head_cfg, head_cfg.aux_layer_ids(cfg.num_layers)).to(torch.bfloat16)
    for name, p in head.named_parameters():
        p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0, 0.02)
    ids = torch.arange(draft_vocab)
    head.d2t = torch.zeros(draft_vocab, dtype=torch.int64)  # draft id i is target id i
    head.t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    head.t2d[ids] = True
    return save_eagle3_head(head, folder)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(batch + 1000 * seed)
    vocab = min(32000, engine.model_config.vocab_size)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens_of = {}  # each request's output tokens, kept when it finishes

    def keep(outputs) -> None:
        tokens_of.update((o.request_id, o.token_ids) for o in outputs if o.finished)

    # Prefill first (not timed), then time decoding alone.
    while any(r.cached_len < len(r.prompt_token_ids) for r in engine.requests.values()):
        keep(engine.step())
    keep(engine.loop.drain())  # the last prefill step, in flight under overlap, is not timed
    sync()
    steps0 = engine.num_steps
    loop0 = engine.loop.stats()
    engine.loop.times.clear()
    produced = sum(len(r.output_token_ids) for r in engine.requests.values())
    GC_PAUSES.clear()
    t0 = time.perf_counter()
    walls, running = [], []
    full = None  # (seconds, tokens) while every request decodes: until the first one ends
    while engine.has_unfinished():
        running.append(len(engine.requests))
        t = time.perf_counter()
        outputs = engine.step()
        walls.append(time.perf_counter() - t)
        keep(outputs)
        if full is None and len(engine.requests) < batch:
            left = engine.requests.values()
            done = sum(len(r.output_token_ids) for r in left) + new_tokens * (batch - len(left))
            full = (time.perf_counter() - t0, done - produced)
    sync()
    seconds = time.perf_counter() - t0
    tokens = batch * new_tokens - produced
    if full is None:  # no step was timed
        full = (seconds, tokens)
    digest = hashlib.sha256(repr([tokens_of.get(i) for i in ids]).encode()).hexdigest()
    in_order = list(walls)
    walls.sort()
    median = walls[len(walls) // 2]
    loop = engine.loop.stats()
    times = engine.loop.times  # each step's device span and the idle gap before it
    span = sum(times.step_ms) / max(1, len(times.step_ms))
    target = sum(times.target_ms) / max(1, len(times.target_ms))
    gap = sum(times.gap_ms) / max(1, len(times.gap_ms))
    reasons = {
        k: v - loop0["loop_wait_reasons"].get(k, 0) for k, v in loop["loop_wait_reasons"].items()
    }
    return {
        "batch": batch,
        "decode_tokens": tokens,
        "seconds": round(seconds, 4),
        "output_tok_s": round(tokens / seconds, 1),
        # decode at the full batch: until the first request ends (requests whose prefill
        # ended in an earlier chunk started decoding then, so they end first, and the last
        # steps of a run decode fewer requests), timed when the step() that processed its
        # last token returns (under overlap the next step is in flight by then: a step's
        # time late at most). With speculation the first to end is the luckiest request,
        # which lifts the rate a little: compare plain rows with plain rows.
        "full_batch": [round(full[0], 4), full[1]],
        "full_batch_tok_s": round(full[1] / full[0], 1),
        "ms_per_step": round(seconds / (engine.num_steps - steps0) * 1e3, 3),
        "steps": engine.num_steps - steps0,
        # tokens per request per step: the realized mean acceptance length where every
        # request decodes in every step (exact at batch 1)
        "tokens_per_request_step": round(tokens / batch / (engine.num_steps - steps0), 3),
        # step() wall times: spikes (drafter catch-ups, compiles) show as max and slow share
        "step_ms_p50_p99_max": [round(walls[int(len(walls) * q)] * 1e3, 3) for q in (0.5, 0.99)]
        + [round(walls[-1] * 1e3, 3)],
        "device_ms_per_step": round(span, 3),
        # of it, the drafter's part (from the step's start to the target's forward)
        "draft_device_ms_per_step": round(span - target, 3),
        "gap_ms_per_step": round(gap, 4),
        "slow_steps_ms": round(sum(w for w in walls if w > 2 * median) * 1e3, 1),
        # where they fell: (step index, ms, requests in the engine before the step)
        "slow_steps": [
            (i, round(w * 1e3, 2), running[i]) for i, w in enumerate(in_order) if w > 2 * median
        ],
        # steps launched only after the previous step's tokens reached the host, and why
        "loop_waits": loop["loop_waits"] - loop0["loop_waits"],
        "loop_wait_reasons": {k: v for k, v in reasons.items() if v},
        # the collector's pauses while decoding (none of generation 2 once start-up froze
        # what it built, as the server's engine process does)
        "gc": GC_PAUSES.summary(),
        # the requests' output tokens, hashed in the order they were added: engines that
        # must compute the same thing (an A/B of a kernel path) must read the same digest
        "tokens_sha256": digest[:16],
    }


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The options this bench shares with gpu_default_model.py: --again, --no-gc-freeze."""
    ap.add_argument(
        "--again", action="store_true", help="run the first configuration again as the last engine"
    )
    ap.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave the collector walking what start-up built (the server's "
        "engine process freezes it, and so does this bench by default)",
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_engine")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--tiny", action="store_true", help="a small shape on the CPU (smoke test)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time each batch size this many times (new requests, whose seeds draw "
        "new simulated acceptance) and report the sums",
    )
    for flag, (label, _, what) in AB_VARIANTS.items():
        ap.add_argument(
            f"--ab-{flag.replace('_', '-')}",
            action="store_true",
            help=f"also plain and fixed K=3 {what} ('{label}')",
        )
    add_run_args(ap)
    ap.add_argument(
        "--ab-plan",
        nargs="+",
        default=None,
        metavar="ROWS,N,K:BN,BK,SPLIT,W,ST",
        help="also plain with these GEMV plan choices forced after whole-step "
        "tuning (e.g. another machine's choices)",
    )
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="run only the configurations whose names contain one of these",
    )
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    tiny = dict(
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_layers=8,
    )
    shape = replace(LLAMA_8B, **tiny) if args.tiny else LLAMA_8B
    model = random_model(shape, device)
    head = random_head(shape, Path(tempfile.mkdtemp()) / "head")
    base = dict(
        device=device,
        dtype="bfloat16",
        max_num_seqs=max(args.batches),
        cuda_graph_max_batch=max(args.batches),
        kv_cache_bytes=2**26 if args.tiny else 24 * 2**30,
        max_num_batched_tokens=4096,
        max_model_len=4096,
    )
    spec = dict(
        speculative_algorithm="eagle3",
        speculative_draft_model_path=str(head),
        speculative_num_steps=3,
        speculative_simulate_acceptance=3.0,
    )
    configs = {
        "plain": {"speculative_algorithm": "none"},
        "eagle3 K=3 fixed (sim. accept len 3.0)": {**spec, "speculative_policy": "fixed"},
        "eagle3 goodput (sim. accept len 3.0)": {**spec, "speculative_policy": "goodput"},
        "eagle3 policy off": {**spec, "speculative_policy": "off"},
    }
    # --ab-X: plain and fixed K=3 once more with one thing changed, for an A/B in one run
    fixed = "eagle3 K=3 fixed (sim. accept len 3.0)"
    for flag, (label, change, _) in AB_VARIANTS.items():
        if getattr(args, f"ab_{flag}"):
            configs[f"plain, {label}"] = {**configs["plain"], **change}
            configs[f"eagle3 K=3 fixed, {label}"] = {**configs[fixed], **change}
    if args.ab_plan:
        configs["plain, forced plan"] = {**configs["plain"], "force_plan": args.ab_plan}
    if args.only:
        configs = {k: v for k, v in configs.items() if any(o in k for o in args.only)}
    if args.again:  # the first engine once more at the end: what the order alone changes
        first = next(iter(configs))
        configs[f"{first} (again, last)"] = configs[first]
    from specserve.kernels import gemv as gemv_module  # kernel modules: imported when needed
    from specserve.kernels import gemv_rope, triton_argmax
    from specserve.kernels.attention import triton_kernels
    from specserve.layers.attention import triton_attn
    from specserve.layers.attention.triton_attn import TritonAttentionBackend
    from specserve.layers.triton_ops import TritonMergedGatedMLP
    from specserve.tuning import gemv_select

    gated, rope_fits = TritonMergedGatedMLP._gated, gemv_module.rope_fits
    chunks = TritonAttentionBackend.invariant_chunks
    min_chunk = triton_attn.INVARIANT_MIN_CHUNK
    rope_rows = gemv_rope.ROPE_MAX_BLOCK_M
    early_metadata = triton_kernels.PDL_EARLY_METADATA

    results = {}
    device_info = None  # which GPU: lent H200s differ by a few percent
    if torch.cuda.is_available():
        name = torch.cuda.get_device_properties(0).name
        device_info = {"name": name, "copy_tb_s": round(copy_bandwidth() / 1e12, 3)}
        print("device", device_info, flush=True)
    for name, extra in configs.items():
        extra = dict(extra)
        # read at each call, and by the drafter's graphs when captured: for this engine
        triton_argmax.set_mode(extra.pop("argmax", "graphs"))
        head = extra.pop("head", True)
        # this engine only (restored below): MLPs never take the gate/up epilogue
        TritonMergedGatedMLP._gated = gated if extra.pop("gate", True) else lambda *a: None
        # this engine only (restored below): no qkv tile takes the rope epilogue
        gemv_module.rope_fits = rope_fits if extra.pop("rope", True) else lambda *a: False
        # this engine only (restored below): attention chunks keys by its program count
        TritonAttentionBackend.invariant_chunks = (
            chunks if extra.pop("attn_chunks", True) else lambda *a: None
        )
        # this engine only (restored below): its backend's shortest invariant chunk
        triton_attn.INVARIANT_MIN_CHUNK = extra.pop("attn_min_chunk", min_chunk)
        # this engine only (restored below): the tallest qkv tile the rope epilogue takes
        gemv_rope.ROPE_MAX_BLOCK_M = extra.pop("rope_max_block_m", rope_rows)
        # this engine only (restored below): decode attention's metadata read under PDL
        triton_kernels.PDL_EARLY_METADATA = extra.pop("early_metadata", early_metadata)
        # this engine only (restored below): how norm-feeding projections' plain keys time
        gemv_select.NORM_AFTER = extra.pop("norm_after", True)
        forced = extra.pop("force_plan", ())
        if forced and extra.get("disable_gemv_tuning"):
            raise SystemExit("--ab-plan forces its choices after whole-step tuning: keep it on")
        restore = force_plan(forced)  # this engine only
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig.from_flags(**base, **extra), model=model)
        startup = time.perf_counter() - t0
        if not head and engine.runner.graphs is not None:  # recaptured without the head
            graphs, engine.runner.graphs = engine.runner.graphs, None
            graphs.logits_head = None
            graphs.capture()
            engine.runner.graphs = graphs
        if not args.no_gc_freeze:  # as server/engine_proc.py does after loading
            gc.collect()
            gc.freeze()
        graphs = engine.runner.graphs.report if engine.runner.graphs else None
        drafter = getattr(engine.spec.proposer, "graphs", None) if engine.spec else None
        for b in args.batches:  # warm-up: Triton compiles each new shape on first use
            run(engine, b, args.prompt_len, 24)  # the timed prompt length: its first-use costs too
        rows = [
            combine(
                [
                    run(engine, b, args.prompt_len, args.new_tokens, seed)
                    for seed in range(args.repeats)
                ]
            )
            for b in args.batches
        ]
        results[name] = {
            "device": device_info,
            "forced_plan": forced or None,  # --ab-plan's specs, set after tuning
            "startup_s": round(startup, 2),
            "graphs": graphs.__dict__ if graphs else None,
            "drafter_graphs": drafter.report.__dict__ if drafter else None,
            "kv_pages": engine.kv.allocator.num_pages,
            **tuning_reports(engine),
            # the start-up GEMV selection's choices, per (row bucket, shape[, fusion])
            "gemv_plan": model.gemv_plan.summary() if model.gemv_plan else None,
            "loop_waits": engine.loop.num_waits,  # steps not launched ahead (all rows)
            "rows": rows,
            "spec": {k: v for k, v in engine.stats().items() if k.startswith("spec_")},
        }
        print(name, json.dumps(results[name]), flush=True)
        gc.unfreeze()  # the engine's cycles must be collectable to free its memory
        del engine
        restore()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    TritonMergedGatedMLP._gated, gemv_module.rope_fits = gated, rope_fits
    TritonAttentionBackend.invariant_chunks = chunks
    triton_attn.INVARIANT_MIN_CHUNK = min_chunk
    gemv_rope.ROPE_MAX_BLOCK_M, triton_kernels.PDL_EARLY_METADATA = rope_rows, early_metadata
    gemv_select.NORM_AFTER = True
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    lines = table(results, args.batches, "output_tok_s")
    lines += ["", "While every request decodes (until the first one ends):", ""]
    lines += table(results, args.batches, "full_batch_tok_s")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
