"""The `specserve` command: generate, serve, bench, train-eagle3, eval-draft."""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields

from specserve.config import EngineConfig
from specserve.errors import SpecserveError

_HELP = {
    "model": "Hugging Face model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)",
    "load_format": "auto: read the model's weights; dummy: random weights of its shape, for "
    "benchmarks (--model then names a preset: llama-3.1-8b, llama-3.1-70b, smollm2-135m, or a "
    "config.json; an EAGLE-3 drafter without a path gets a random head)",
    "dtype": "compute dtype: auto, float32, float16, bfloat16",
    "device": "auto, cpu, cuda, cuda:N",
    "page_size": "tokens per KV cache page",
    "kv_cache_bytes": "KV cache memory budget in bytes (default: 256 MiB on CPU; on CUDA "
    "--kv-cache-memory-fraction of the free memory)",
    "kv_cache_memory_fraction": "on CUDA without --kv-cache-bytes: the share of the GPU memory "
    "free after loading the weights that the KV cache takes",
    "num_kv_pages": "KV cache size in pages (overrides --kv-cache-bytes)",
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": "per-step token budget; longer prefills are chunked",
    "max_model_len": "context length limit (default: the model's)",
    "seed": "seed for requests that bring none",
    "speculative_algorithm": "eagle3, draft, ngram, none, or auto (default: eagle3 with the "
    "shipped head on the embedded default model, none for other models)",
    "speculative_draft_model_path": "draft model folder/.gguf or EAGLE-3 head folder",
    "speculative_num_steps": "K_max, the most draft tokens per request per step",
    "speculative_policy": "off, fixed, schedule, goodput (default with a drafter: goodput)",
    "speculative_schedule": "batch size -> K table for the schedule policy, e.g. 1:4,16:2,64:0",
    "attention_backend": "auto (triton on CUDA, torch on CPU), torch, triton",
    "disable_cuda_graph": "run every step eagerly (debugging)",
    "disable_gemv": "no start-up choice of Triton GEMV kernels: cuBLAS for every linear "
                    "(the same kernels on every start)",
    "disable_gemv_tuning": "keep the GEMV kernels start-up selection timed alone, without "
    "revising them in whole decode steps (runtime/plan_tuning.py) nor searching verify "
    "tiles (runtime/verify_tiles.py)",
    "disable_batch_invariance": "let cuBLAS serve decode-sized linears of up to 16 rows even "
    "where it rounds a row differently at different row counts, and verify steps take the "
    "kernels of their row count, not of their requests' decode step, and attention splits "
    "a request's keys by the step's program count (faster on some shapes; greedy "
    "speculation may then drift from plain decoding)",
    "disable_verify_tiles": "verify steps of up to 16 requests run the GEMV tiles their "
    "requests' decode steps run at every row count, without the start-up search for faster "
    "tiles that give their rows the same bits (runtime/verify_tiles.py)",
    "disable_pdl": "launch Triton kernels without programmatic dependent launch (on by default "
    "on GPUs of compute capability 9+: a kernel starts while the previous one ends)",
    "gemv_stream_k": "EXPERIMENTAL: also time stream-K GEMV tiles (one program per "
    "multiprocessor, split tiles summed by the last to finish) for steps of more than 16 "
    "rows (on an H200, start-up chose none for the Llama-3.1-8B shape)",
    "disable_fusion": "keep SiLU-and-mul and the split-K passes of the output and down "
    "projections as kernels of their own (by default fused into the GEMV and the next "
    "RMSNorm; same results)",
    "overlap_schedule": "auto (on for CUDA, off on CPU), on, off: build step N+1 on the CPU "
    "while step N runs",
    "disable_overlap_schedule": "the synchronous step loop (same as --overlap-schedule off)",
    "cuda_graph_max_batch": "largest batch bucket captured as a CUDA graph",
    "speculative_simulate_acceptance": "BENCHMARKING ONLY: replace acceptance by seeded draws "
    "(rate per token <= 1, or mean acceptance length > 1); outputs are not the model's",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, defaults taken from the dataclass."""
    for f in fields(EngineConfig):
        default = None if f.default is MISSING else f.default
        annotation = str(f.type)
        flag = "--" + f.name.replace("_", "-")
        if annotation == "bool":
            parser.add_argument(flag, action="store_true", help=_HELP.get(f.name))
            continue
        kind = str if "str" in annotation else float if "float" in annotation else int
        parser.add_argument(flag, type=kind, default=default, help=_HELP.get(f.name))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def _generate(args: argparse.Namespace) -> int:
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    cfg = engine_config(args)
    llm = LLM(progress=True, **{f.name: getattr(cfg, f.name) for f in fields(EngineConfig)})
    prompt: str | list[int] = args.prompt
    if llm.tokenizer.chat_template and not args.no_chat_template:
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop=args.stop or [],
    )
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from specserve.server.config import ServerConfig
    from specserve.server.launch import run_server

    try:
        cfg = engine_config(args)
        server = ServerConfig(
            host=args.host, port=args.port, api_key=args.api_key,
            served_model_names=args.served_model_name or [], max_queue=args.max_queue,
            shutdown_timeout_s=args.shutdown_timeout, log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
        )
    except ValueError as e:
        raise SpecserveError(str(e)) from e
    return run_server(cfg, server)


def _add_serve_parser(sub) -> None:
    from specserve.server.config import ServerConfig as D  # defaults come from the dataclass

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    add_engine_args(srv)
    srv.add_argument("--host", default=D.host, help="address to bind")
    srv.add_argument("--port", type=int, default=D.port)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    srv.add_argument("--served-model-name", nargs="+", default=None,
                     help="model name(s) clients use (default: the model's name)")
    srv.add_argument("--max-queue", type=int, default=D.max_queue,
                     help="engine requests allowed to wait; beyond it 429 + Retry-After")
    srv.add_argument("--shutdown-timeout", type=float, default=D.shutdown_timeout_s,
                     help="seconds SIGTERM waits for in-flight requests before aborting them")
    srv.add_argument("--uvicorn-log-level", default=D.log_level,
                     choices=["critical", "error", "warning", "info", "debug"])
    srv.add_argument("--disable-uvicorn-access-log", action="store_true")
    srv.set_defaults(func=_serve)


def _train_eagle3(args: argparse.Namespace) -> int:
    from specserve.train.config import config_from_args
    from specserve.train.trainer import run_cli

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        raise SpecserveError(str(e)) from e
    return run_cli(cfg)


def _add_train_parser(sub) -> None:
    from specserve.train.config import add_train_args  # flags derive from TrainConfig

    tr = sub.add_parser("train-eagle3", help="train an EAGLE-3 draft head by self-distillation")
    add_train_args(tr)
    tr.set_defaults(func=_train_eagle3)


def _add_bench_parser(sub) -> None:
    from specserve.bench.commands import add_bench_commands

    bench = sub.add_parser("bench", help="serving benchmark: load test, sweep, plots")
    add_bench_commands(bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--no-chat-template", action="store_true", help="send the prompt as is")
    gen.set_defaults(func=_generate)
    _add_serve_parser(sub)
    _add_train_parser(sub)
    from specserve.spec.eval_draft import add_eval_draft_parser

    add_eval_draft_parser(sub)
    _add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecserveError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
