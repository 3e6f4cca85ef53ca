"""Plain-decode throughput of a random-weight Llama-3.1-8B-shaped bf16 model on one GPU.

The model is specserve's LlamaForCausalLM built directly on the GPU from a ModelConfig (no
checkpoint). The engine cannot take a prebuilt model yet, so a minimal driver
(gpu_bench_driver.py) uses the parts directly: KVCache and its PageAllocator, an attention
backend, the model, greedy argmax. All prompts are prefilled in one packed forward, then each
decode step advances positions, KV slots and seq_lens on the device; the decode loop never
waits for the host.

Configurations, side by side in one run: the torch reference backend eager; the Triton
backend with the fused Triton ops, eager; the same under CUDA graphs; and CUDA graphs with
the Triton backend but PyTorch norm/rotary/MLP (what the fused ops buy). Also: HBM copy
bandwidth and the weights-streaming bound, the weights-only GEMM chain under a graph, every
captured graph's step time, and a kernel-time profile of one eager step.

    python scripts/gpu_bench.py                          # writes JSON to $OUT (or ./out)
    TRITON_INTERPRET=1 python scripts/gpu_bench.py --tiny --device cpu   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_bench_driver import (  # noqa: E402
    EagerStep,
    GraphStep,
    agreement,
    build_model,
    generate,
    sync,
)
from gpu_bench_parts import (  # noqa: E402
    attention_sweep,
    copy_bandwidth,
    gemm_chain_ms,
    graph_step_ms,
    kernel_profile,
    sample_ms,
)

from specserve.engine.kv_cache import KVCache  # noqa: E402
from specserve.layers import triton_ops  # noqa: E402
from specserve.layers.attention import get_backend  # noqa: E402
from specserve.model.hf_config import ModelConfig, RopeScaling  # noqa: E402
from specserve.runtime.cuda_graphs import CudaGraphRunner  # noqa: E402


def llama8b_config(tiny: bool) -> ModelConfig:
    shape = dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128, vocab_size=128256)  # fmt: skip
    if tiny:
        shape = dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=32, vocab_size=1000)  # fmt: skip
    return ModelConfig(
        architecture="LlamaForCausalLM", rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), dtype=torch.bfloat16, **shape,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--graph-max-seq-len", type=int, default=4096)
    ap.add_argument("--graph-buckets", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--graph-tokens", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tiny", action="store_true", help="tiny model (smoke test)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16
    if device.type == "cpu":
        dtype = torch.float32  # the interpreter cannot do bf16 dots
    cuda = device.type == "cuda"
    result: dict = dict(command=" ".join(["python", "scripts/gpu_bench.py", *sys.argv[1:]]),
                        args=vars(args), torch=torch.__version__)  # fmt: skip
    if cuda:
        import triton

        result.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__)
    cfg = llama8b_config(args.tiny)
    t = time.perf_counter()
    model = build_model(cfg, dtype, device)
    sync(device)
    result["build_s"] = time.perf_counter() - t
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if "embed_tokens" not in n)  # fmt: skip
    result["weights_gb"] = weight_bytes / 1e9
    max_batch = max(args.batches + args.graph_buckets)
    tokens_per_req = args.prompt_len + args.new_tokens
    num_pages = 1 + max_batch * -(-tokens_per_req // args.page_size)
    kv = KVCache(cfg, num_pages, args.page_size, dtype, device)
    kv_token_bytes = cfg.kv_bytes_per_token(dtype)
    if cuda:
        bw = copy_bandwidth()
        mean_ctx = args.prompt_len + args.new_tokens / 2
        result["copy_gbps"] = bw / 1e9
        result["bounds"] = {
            str(b): b / ((weight_bytes + b * mean_ctx * kv_token_bytes) / bw)
            for b in args.batches
        }  # tok/s if a step only streamed the weights and the KV once
        result["gemm_chain_ms"] = {str(m): gemm_chain_ms(model, m) for m in (1, 64, 256)}
        result["sample_ms"] = {str(b): sample_ms(model, b) for b in args.batches}
        print(f"copy {bw / 1e9:.0f} GB/s, weights {weight_bytes / 1e9:.2f} GB, bounds "
              f"{result['bounds']}, gemm chain {result['gemm_chain_ms']}", flush=True)

    torch_backend, tuned = get_backend("torch"), get_backend("triton")
    if cuda:
        sweep = attention_sweep(kv, cfg.num_heads, args.prompt_len + args.new_tokens // 2,
                                args.graph_max_seq_len, ((64, 1), (1, 1), (64, 4), (16, 1)))
        tuned = sweep.pop("chosen_backend")
        result["attention_sweep"] = sweep
        print(f"attention sweep: best {sweep['best']} (score {sweep['best_score']}, default "
              f"{sweep['default_score']})", flush=True)  # fmt: skip
        save(result, args.out)
    # (name, backend, fused ops, CUDA graphs)
    configs = [("torch-eager", torch_backend, False, False), ("triton-eager", tuned, True, False)]
    if cuda:
        configs += [("triton-graphs", tuned, True, True),
                    ("triton-graphs-default-launch", get_backend("triton"), True, True),
                    ("triton-graphs-unfused-ops", tuned, False, True)]  # fmt: skip
    runs, tokens = [], {}
    for name, backend, fused, graphs in configs:
        try:
            run_config(args, result, model, kv, name, backend, fused, graphs, runs, tokens)
        except Exception as e:  # keep the other configurations' numbers
            runs.append(dict(config=name, error=f"{type(e).__name__}: {e}"))
            print(f"{name} FAILED: {e!r}", flush=True)
        if cuda:
            torch.cuda.empty_cache()
        result["runs"] = runs
        save(result, args.out)
    if cuda:
        triton_ops.use_triton_ops(model)  # the profile of the fused-ops model
        result["profile_us_per_step"] = {
            str(b): kernel_profile(model, kv, tuned, b, args.prompt_len) for b in args.batches
        }
        save(result, args.out)
    print_table(result)


def save(result: dict, out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_decode.json").write_text(json.dumps(result, indent=1, default=str))


def run_config(args, result, model, kv, name, backend, fused, graphs, runs, tokens) -> None:
    triton_ops.use_triton_ops(model, enable=fused)
    step = EagerStep(model, kv, backend)
    if graphs:
        full = name == "triton-graphs"
        buckets = args.graph_buckets if full else sorted(set(args.batches))
        q_set = args.graph_tokens if full else [1]
        runner = CudaGraphRunner(model, kv.layers, backend, tuple(buckets), tuple(q_set),
                                 max_seq_len=args.graph_max_seq_len)  # fmt: skip
        report = runner.capture()
        result[f"capture[{name}]"] = vars(report)
        print(f"{name}: captured {report}", flush=True)
        step = GraphStep(runner)
        if full:
            ctx = args.prompt_len + args.new_tokens // 2
            result["graph_step_ms"] = graph_step_ms(runner, kv, ctx)
    for batch in args.batches:
        generate(model, kv, step, batch, args.prompt_len, 4)  # warm-up
        r = generate(model, kv, step, batch, args.prompt_len, args.new_tokens)
        tokens[(name, batch)] = r.pop("tokens"), r.pop("prefill_hidden")
        r["config"] = name
        for other in ("torch-eager", "triton-graphs"):
            if (other, batch) in tokens:
                ref_tokens, ref_hidden = tokens[(other, batch)]
                r[f"greedy_agreement_vs_{other}"] = agreement(tokens[(name, batch)][0], ref_tokens)
                err = (tokens[(name, batch)][1] - ref_hidden).norm() / ref_hidden.norm()
                r[f"prefill_hidden_rel_err_vs_{other}"] = float(f"{err.item():.3g}")
        runs.append(r)
        print(f"{name:28s} batch {batch:3d}: {r['decode_tok_s']:9.1f} tok/s decode, "
              f"{r['step_ms']:7.2f} ms/step, e2e {r['e2e_tok_s']:9.1f} tok/s", flush=True)


def print_table(result: dict) -> None:
    nan = float("nan")
    print("\n| config | batch | decode tok/s | ms/step | prefill s | e2e tok/s | agree vs torch "
          "| prefill hidden err vs torch |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["runs"]:
        if "error" in r:
            print(f"| {r['config']} | error: {r['error'][:200]} |")
            continue
        print(f"| {r['config']} | {r['batch']} | {r['decode_tok_s']:.1f} | {r['step_ms']:.2f} "
              f"| {r['prefill_s']:.3f} | {r['e2e_tok_s']:.1f} "
              f"| {r.get('greedy_agreement_vs_torch-eager', nan):.2f} "
              f"| {r.get('prefill_hidden_rel_err_vs_torch-eager', nan):.2g} |")  # fmt: skip
    for key in ("bounds", "gemm_chain_ms", "sample_ms", "graph_step_ms", "profile_us_per_step"):
        if key in result:
            print(f"{key}: {json.dumps(result[key])}")
    sweep = result.get("attention_sweep")
    if sweep:
        print(f"attention: chosen {sweep['best']} us {sweep['best_us']}; "
              f"default us {sweep['default_us']}")  # fmt: skip
    if "copy_gbps" in result:
        print(f"copy bandwidth {result['copy_gbps']:.0f} GB/s; weights "
              f"{result['weights_gb']:.2f} GB")  # fmt: skip


if __name__ == "__main__":
    main()
