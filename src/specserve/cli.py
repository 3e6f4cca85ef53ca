"""The `specserve` command: generate, serve, bench, train-eagle3, eval-draft. Exit status:
0 done, 2 an error the user can fix (said in one line), 130 interrupted (Ctrl-C), and for
`serve` 1 when it could not start and 3 when its engine process died while serving."""

from __future__ import annotations

import argparse
import sys

from specserve.core.errors import InvalidRequestError, SpecserveError
from specserve.engine_args import (
    ENGINE_FLAGS,
    ArgumentParser,
    add_engine_args,
    engine_arg_groups,
    engine_config,
    flag_message,
    has_engine_args,
)

SAMPLING_FLAGS = {
    "max_tokens": "--max-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "seed": "--sampling-seed",
    "stop": "--stop",
}  # SamplingParams field -> flag


def _sampling_params(args: argparse.Namespace):
    from specserve.core.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop=args.stop or [],
    )


def _generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)  # refused here, before the model loads
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # (bytes the locale could not decode, escaped)
        raise SpecserveError(
            f"the prompt is not UTF-8 text (character {e.start} is not a character); pass "
            "it in UTF-8"
        ) from None
    from specserve.llm import LLM

    cfg = engine_config(args)
    if cfg.parallel.node_rank > 0:
        return _follow_node(cfg)
    with LLM(progress=not args.quiet, **cfg.flags()) as llm:
        _print_stream(llm, args, params)
    return 0


def _follow_node(cfg) -> int:
    """A machine other than the first under tensor parallelism (--node-rank > 0): its ranks
    follow rank 0 (on machine 0) until it stops them; nothing is served or printed here."""
    from specserve.engine.engine import LLMEngine
    from specserve.engine.tensor_parallel import node_ranks

    ranks = node_ranks(cfg)
    par = cfg.parallel
    print(
        f"specserve: machine {par.node_rank} of {par.nnodes}: ranks {ranks[0]}-{ranks[-1]} "
        f"follow rank 0 at {par.dist_init_addr}",
        file=sys.stderr,
    )
    LLMEngine(cfg).follow()
    return 0


def _print_stream(llm, args: argparse.Namespace, params) -> None:
    if llm.tokenizer.chat_template and not args.no_chat_template:
        # what llm.chat does: the answer of an instruct model, not a continuation
        prompt: str | list[int] = llm.apply_chat_template(
            [{"role": "user", "content": args.prompt}]
        )
    else:
        prompt = args.prompt
    wrote = False
    try:
        for delta in llm.stream(prompt, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
            wrote = True
    except KeyboardInterrupt:  # (the partial answer ends its line too)
        if wrote:
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    sys.stdout.write("\n")


def _serve(args: argparse.Namespace) -> int:
    from specserve.server.config import ServerConfig, resolve_api_key
    from specserve.server.launch import run_server

    try:
        cfg = engine_config(args)
        server = ServerConfig(
            host=args.host,
            port=args.port,
            api_key=resolve_api_key(args.api_key, args.api_key_file),
            served_model_names=args.served_model_name or [],
            max_queue=args.max_queue,
            shutdown_timeout_s=args.shutdown_timeout,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            max_request_bytes=args.max_request_bytes,
            request_read_timeout_s=args.request_read_timeout,
            keep_alive_timeout_s=args.keep_alive_timeout,
            public_metrics=args.public_metrics,
        )
    except ValueError as e:
        raise SpecserveError(str(e)) from e
    if cfg.parallel.node_rank > 0:  # machine 0 serves; this one's ranks follow it
        return _follow_node(cfg)
    return run_server(cfg, server)


def _add_serve_parser(sub) -> None:
    from specserve.server.config import ServerConfig as D  # defaults come from the dataclass

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    advanced = add_engine_args(srv)["advanced"]
    net = srv.add_argument_group("serving")
    net.add_argument("--host", default=D.host, help="address to bind")
    net.add_argument("--port", type=int, default=D.port, metavar="N", help="port to listen on")
    net.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model name(s) clients use (default: the model's name)",
    )
    net.add_argument(
        "--max-queue",
        type=int,
        default=D.max_queue,
        metavar="N",
        help="engine requests (prompts x n) allowed to wait for a running slot; "
        "beyond it 429 + Retry-After",
    )
    net.add_argument(
        "--shutdown-timeout",
        type=float,
        default=D.shutdown_timeout_s,
        metavar="S",
        help="seconds SIGTERM waits for in-flight requests before aborting them",
    )
    advanced.add_argument(
        "--uvicorn-log-level",
        default=D.log_level,
        choices=["critical", "error", "warning", "info", "debug"],
        help="how much the HTTP server logs",
    )
    advanced.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request"
    )
    sec = srv.add_argument_group("security and limits")
    sec.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(visible in `ps`: prefer --api-key-file or SPECSERVE_API_KEY)",
    )
    sec.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="read the API key from the first line of this file",
    )
    sec.add_argument(
        "--public-metrics",
        action="store_true",
        help="serve /metrics without the API key (Prometheus scrapers)",
    )
    sec.add_argument(
        "--max-request-bytes",
        type=int,
        default=D.max_request_bytes,
        metavar="N",
        help="largest request body accepted (413 beyond)",
    )
    sec.add_argument(
        "--request-read-timeout",
        type=float,
        default=D.request_read_timeout_s,
        metavar="S",
        help="seconds a request's headers, and its body, may take "
        "to arrive; stalled connections are closed",
    )
    sec.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=D.keep_alive_timeout_s,
        metavar="S",
        help="seconds an idle kept-alive connection stays open",
    )
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


def _add_generate_parser(sub) -> None:
    from specserve.core.sampling_params import SamplingParams as D  # defaults of the Python API

    gen = sub.add_parser(
        "generate",
        help="generate text for one prompt, streamed to stdout",
        description="Answer one prompt (with the model's chat template) "
        "and stream the text to stdout; start-up progress goes to stderr.",
    )
    gen.add_argument("prompt", help="the prompt (a user message, unless --no-chat-template)")
    gen.add_argument(
        "--no-chat-template",
        action="store_true",
        help="send the prompt as is, without the model's chat template",
    )
    gen.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="print only the generated text (no start-up progress on stderr)",
    )
    groups = engine_arg_groups(gen)
    sampling = groups["sampling"]
    sampling.add_argument(
        "--max-tokens", type=int, default=D.max_tokens, metavar="N", help="most tokens to generate"
    )
    sampling.add_argument(
        "--temperature",
        type=float,
        default=D.temperature,
        metavar="X",
        help="randomness of sampling; 0 always picks the likeliest token",
    )
    sampling.add_argument(
        "--top-k",
        type=int,
        default=D.top_k,
        metavar="N",
        help="sample among the N likeliest tokens only; 0 turns this off",
    )
    sampling.add_argument(
        "--top-p",
        type=float,
        default=D.top_p,
        metavar="X",
        help="sample among the likeliest tokens whose probabilities add up to X; 1 turns this off",
    )
    sampling.add_argument(
        "--min-p",
        type=float,
        default=D.min_p,
        metavar="X",
        help="skip tokens less likely than X times the likeliest; 0 turns this off",
    )
    sampling.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        metavar="N",
        help="seed of this prompt's random draws (default: one drawn from "
        "--seed, so a run repeats itself)",
    )
    sampling.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="stop where this text appears (it is not printed); repeat the "
        "flag for several (default: none)",
    )
    add_engine_args(gen, groups)
    gen.set_defaults(func=_generate)


def build_parser() -> argparse.ArgumentParser:
    """The `specserve` command and its subcommands."""
    parser = ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    _add_generate_parser(sub)
    _add_serve_parser(sub)
    _add_train_parser(sub)
    from specserve.bench.eval_draft import add_eval_draft_parser

    add_eval_draft_parser(sub)
    _add_bench_parser(sub)
    return parser


def _as_typed(error: SpecserveError, args: argparse.Namespace) -> str:
    """The error's message with option names written as the flags the user typed."""
    message = str(error)
    if isinstance(error, InvalidRequestError) and args.command == "generate":
        message = flag_message(message, SAMPLING_FLAGS)
    if has_engine_args(args):
        message = flag_message(message, ENGINE_FLAGS)
    return message


def main(argv: list[str] | None = None) -> int:
    """Run the command line. Exit status: 0 done; 2 an error the user can fix (a flag, a
    file, a model that cannot load), said in one line; 130 interrupted (Ctrl-C: said in one
    line, the partial answer ended with a newline); `serve` also 1 when it could not start
    and 3 when its engine process died while serving."""
    args = build_parser().parse_args(argv)
    try:
        if has_engine_args(args):  # every check that needs no model, before any loads
            engine_config(args).load.check_device()
        return args.func(args)
    except SpecserveError as e:
        print(f"specserve: error: {_as_typed(e, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (the engine and its ranks are closed on the way out)
        print("specserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
