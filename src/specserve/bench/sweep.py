"""`specserve bench sweep`: one server per configuration, a load run per concurrency, and the
results as JSON, a markdown table and a plot.

Every configuration sees the same prompts at a given concurrency (and round); each level
and round has prompts of its own (datasets.build_dataset's `part`), so no run replays
earlier prompts into a server whose prefix cache kept them. A level sends max(num_prompts,
R x concurrency) requests (R: --requests-per-concurrency, default 2) so that the
concurrency is held for more than one wave, not only reached. Each server gets warm-up
requests (a prompt no level sends) before it is measured.
`warm_up` and `measure` serve the adaptive-speculation matrix too (matrix_run.py).

With `rounds` > 1 the servers run side by side and every (concurrency, configuration) is
measured once a round, the configurations taking turns at each concurrency (their order
rotated by one each round); bench/rounds.py sums the rounds up. Where the host paces the
steps (a small model), the lent machines' CPUs run identical steps up to 60% slower for
stretches of seconds: one server after another, such a stretch lands on one configuration
and decides the comparison; taking turns spreads it over all of them, and a ratio taken
within a round (`ratio_to`) pairs runs seconds apart.
"""

from __future__ import annotations

import os
import platform
import shlex
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

from specserve.bench.conversations import Conversation
from specserve.bench.datasets import BenchPrompt, Dataset
from specserve.bench.load import LoadConfig
from specserve.bench.report import policy_table, save_json, step_kinds, step_ms_by_k
from specserve.bench.rounds import median_rows, medians_table
from specserve.bench.runner import benchmark
from specserve.bench.server_process import ServerProcess

# The engine's host time a step, by part, in the order a step runs (server/metrics.py).
HOST_PARTS = ("schedule", "draft", "prepare", "forward", "sample", "process")
_LOG_TAIL_CHARS = 6000  # of a server's log, kept with a run whose requests failed

DEFAULT_CONFIGS = {
    "off": "--speculative-algorithm none",
    "ngram-fixed-k3": "--speculative-algorithm ngram --speculative-policy fixed "
    "--speculative-num-steps 3",
    "ngram-goodput-k3": "--speculative-algorithm ngram --speculative-policy goodput "
    "--speculative-num-steps 3",
}


@dataclass
class SweepPlan:
    """What to run: named server configurations (extra `specserve serve` flags each), the
    flags every server gets, and the concurrencies."""

    configs: dict[str, list[str]]
    concurrencies: list[int]
    num_prompts: int
    server_args: list[str]
    load: LoadConfig  # the template: base_url and max_concurrency are filled per run
    warmup_requests: int = 2
    server_env: dict[str, str] | None = None
    log_dir: Path | None = None
    rounds: int = 1  # > 1: the servers side by side, taking turns (module docstring)


# Flags that size a server's KV cache without reference to the free device memory: servers
# that run side by side need one (else the first takes most of the GPU's memory).
KV_SIZE_FLAGS = ("--kv-cache-bytes", "--num-kv-pages")


def sized_kv_cache(flags: list[str]) -> bool:
    """Whether server flags give the KV cache an explicit size."""
    return any(f == k or f.startswith(k + "=") for f in flags for k in KV_SIZE_FLAGS)


def parse_configs(specs: list[str] | None) -> dict[str, list[str]]:
    """NAME=FLAGS strings (FLAGS split like a shell would) to {name: flags}."""
    if not specs:
        return {k: shlex.split(v) for k, v in DEFAULT_CONFIGS.items()}
    out = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            raise ValueError(
                f"--config takes NAME=FLAGS (e.g. 'ngram-k3=--speculative-"
                f"algorithm ngram'); got {spec!r}"
            )
        out[name] = shlex.split(flags)
    return out


def machine_info() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.machine()}",
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def warm_up(
    load: LoadConfig, server: ServerProcess, prompt: BenchPrompt | Conversation, n: int
) -> None:
    """n short requests one at a time, not measured (first requests pay one-off costs); of a
    conversation, its first turn. The workload's shared prefix goes with them, so a prefix
    cache is warm when measuring starts, as it is in a server serving that prefix."""
    if isinstance(prompt, Conversation):
        prompt = prompt.turn_prompt(0, [], chat=load.endpoint == "chat")
    if n:
        warm = Dataset("warmup", [replace(prompt, max_tokens=min(prompt.max_tokens, 16))] * n)
        benchmark(
            replace(load, base_url=server.url, max_concurrency=1, request_rate=float("inf")),
            warm,
            progress=False,
        )


def measure(
    cfg: LoadConfig,
    dataset: Dataset,
    label: str,
    flags: list[str],
    progress: bool = True,
    desc: str | None = None,
    server: ServerProcess | None = None,
) -> dict:
    """One measured run, labelled, with the machine's load average around it; prints a line.
    When requests failed, the tail of the server's log goes into the report (the server's
    log folder may be gone with the machine that ran it)."""
    load_before = _load_avg()
    report = benchmark(cfg, dataset, progress=progress, desc=desc or label)
    if report["failed"] and server is not None:
        report["server_log_tail"] = server.log_tail(_LOG_TAIL_CHARS)
    # Other work on the machine skews a comparison across configurations, which run at
    # different times: keep the 1-minute load average around each run.
    report["load_avg_1m"] = [load_before, _load_avg()]
    report["label"] = label
    report["server_flags"] = flags
    steps = report.get("server") or {}
    step_ms = f"  step {steps['step_ms_mean']:.2f} ms" if "step_ms_mean" in steps else ""
    if "device_busy_ms_mean" in steps:
        step_ms += f" (device {steps['device_busy_ms_mean']:.2f})"
    waits = f"  waits {steps['loop_waits']}" if "loop_waits" in steps else ""
    parts = steps.get("ttft_parts_ms_mean")
    ttft = ""
    if parts:  # the server's TTFT and where it went (metrics_client.ttft_figures)
        ttft = "  server TTFT {:.1f} ms ({:.1f} to engine, {:.1f} in, {:.1f} back)".format(
            steps["ttft_ms_mean"], parts["to_engine"], parts["in_engine"], parts["back"]
        )
        outside = steps.get("ttft_outside_ms_mean")
        if outside:  # the server's time before submission and after: the rest is the client's
            ttft += " + {:.1f} before, {:.1f} out".format(outside["intake"], outside["first_chunk"])
    host = steps.get("host_ms_by_part_mean")
    if host:  # where the engine's host time a step went (metrics_client.step_figures)
        waits += "  host ms " + ", ".join(
            f"{part} {host[part]:.2f}" for part in HOST_PARTS if host.get(part)
        )
    kinds = step_kinds(steps)
    if kinds:  # each kind of step's mean (decode-only or carrying prefill, by K)
        step_ms += f" [device by kind: {kinds}]"
    by_k = step_ms_by_k(steps.get("speculation") or {})
    if by_k:  # a speculating server's mean step at each K it ran
        step_ms += f" [{by_k}]"
    spec = steps.get("speculation") or {}
    if spec.get("settled_steps"):  # steps the goodput policy did not deliberate
        step_ms += f" [{spec['settled_steps']} settled]"
    if spec.get("policy_tables"):  # and what the goodput policy believed of them
        step_ms += f" [{policy_table(spec, cfg.max_concurrency)}]"
    print(
        f"[sweep] {desc or label:>24} {report['output_throughput']:8.1f} tok/s  "
        f"p50 ITL {_ms(report['itl_ms']['p50'])} ms  "
        f"p50 TPOT {_ms(report['tpot_ms']['p50'])} ms{step_ms}{waits}{ttft}  "
        f"errors {report['failed']}",
        flush=True,
    )
    return report


def run_sweep(
    plan: SweepPlan,
    datasets: Callable[[int, int], Dataset],
    warm: BenchPrompt | Conversation,
    progress: bool = True,
    on_server_done: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Every configuration at every concurrency; returns one report per (config, level), or
    with `plan.rounds` > 1 one per (round, level, config) (`run_side_by_side`).
    `datasets(level, round)` is each point's workload, the same for every configuration
    (each point's own prompts: none replayed into a server that cached them); `warm` the
    warm-up's prompt (a prompt no point sends). `on_server_done` gets the reports so far
    after each server (to save them as it goes)."""
    log_dir = plan.log_dir or Path(tempfile.mkdtemp(prefix="specserve-sweep-"))
    if plan.rounds > 1:
        return run_side_by_side(plan, datasets, warm, log_dir, progress, on_server_done)
    rows = []
    for name, flags in plan.configs.items():
        flags_text = shlex.join(plan.server_args + flags)
        print(f"[sweep] starting server '{name}': specserve serve {flags_text}", flush=True)
        with ServerProcess(
            plan.server_args + flags, log_dir / f"{name}.log", env=plan.server_env
        ) as server:
            warm_up(plan.load, server, warm, plan.warmup_requests)
            for c in plan.concurrencies:
                cfg = replace(plan.load, base_url=server.url, max_concurrency=c)
                rows.append(
                    measure(cfg, datasets(c, 0), name, flags, progress, f"{name} c={c}", server)
                )
        if on_server_done is not None:
            on_server_done(rows)
    return rows


def run_side_by_side(
    plan: SweepPlan,
    datasets: Callable[[int, int], Dataset],
    warm: BenchPrompt | Conversation,
    log_dir: Path,
    progress: bool = True,
    on_round_done: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Every configuration's server started (and warmed up) first, then `plan.rounds` rounds:
    at each concurrency every configuration in turn, the order rotated by one each round.
    Each report carries its `round` (0-based); `on_round_done` gets the reports so far
    after each round. Every server is stopped on the way out, whatever happened."""
    names = list(plan.configs)
    rows: list[dict] = []
    with ExitStack() as stack:
        servers = {}
        for name in names:
            flags = plan.configs[name]
            flags_text = shlex.join(plan.server_args + flags)
            print(f"[sweep] starting server '{name}': specserve serve {flags_text}", flush=True)
            server = stack.enter_context(
                ServerProcess(
                    plan.server_args + flags, log_dir / f"{name}.log", env=plan.server_env
                )
            )
            warm_up(plan.load, server, warm, plan.warmup_requests)
            servers[name] = server
        for r in range(plan.rounds):
            shift = r % len(names)
            order = names[shift:] + names[:shift]
            for c in plan.concurrencies:
                for name in order:
                    server = servers[name]
                    cfg = replace(plan.load, base_url=server.url, max_concurrency=c)
                    desc = f"{name} c={c} round {r + 1}/{plan.rounds}"
                    row = measure(
                        cfg, datasets(c, r), name, plan.configs[name], progress, desc, server
                    )
                    row["round"] = r
                    rows.append(row)
            if on_round_done is not None:
                on_round_done(rows)
    return rows


def _load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _load(pair: list | None) -> str:
    if not pair or None in pair:
        return "-"
    return f"{pair[0]:.1f}→{pair[1]:.1f}"


def markdown_table(rows: list[dict]) -> str:
    """One line per (configuration, concurrency), per round in a side-by-side sweep."""
    head = (
        "| config | concurrency | requests ok/sent | req/s | output tok/s | TTFT p50 ms | "
        "ITL p50 ms | TPOT p50 ms | e2e p50 ms | tok/chunk | step ms | accept len | "
        "draft-length mix | load 1m |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        server = r.get("server") or {}
        spec = server.get("speculation") or {}
        accept = spec.get("mean_acceptance_length")
        step = "-" if "step_ms_mean" not in server else f"{server['step_ms_mean']:.2f}"
        if step_ms_by_k(spec):
            step += f" ({step_ms_by_k(spec)})"
        mix = ", ".join(f"{k}:{v:.0%}" for k, v in (spec.get("draft_length_mix") or {}).items())
        label = r["label"] if "round" not in r else f"{r['label']} (round {r['round'] + 1})"
        lines.append(
            f"| {label} | {r['config']['max_concurrency']} | {r['completed']}/"
            f"{r['num_requests']} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} "
            f"| {_ms(r['ttft_ms']['p50'])} | {_ms(r['itl_ms']['p50'])} | "
            f"{_ms(r['tpot_ms']['p50'])} | {_ms(r['e2e_latency_ms']['p50'])} | "
            f"{_num(r.get('tokens_per_chunk'))} | {step} | {_num(accept)} | {mix or '-'} | "
            f"{_load(r.get('load_avg_1m'))} |"
        )
    return "\n".join(lines) + "\n"


_COLUMNS = (
    "TTFT: request sent to the first streamed text (a token whose text the server holds back, "
    "a partial UTF-8 character or a special token, comes with a later chunk). ITL: gap "
    "between successive text chunks (one chunk can carry several tokens). TPOT: (e2e - TTFT) "
    "/ (output tokens - 1). tok/chunk: output tokens after the first per text chunk after "
    "the first; not per decode step: steps whose text is held back send no chunk, so it can "
    "read above 1 without speculation (an upper bound on a request's mean tokens per "
    "decode step). step ms: the server's mean step (by K when it speculates). "
    "accept len and draft-length mix: from the server's /metrics, "
    "when it exports them. load 1m: the machine's 1-minute load average before and after the "
    "run (other work on the machine makes configurations measured at different times hard to "
    "compare)."
)


def markdown_report(sweep: dict, stem: str) -> str:
    """The sweep as a page: command, machine, configurations, plot and table."""
    m = sweep.get("machine") or {}
    env = " ".join(f"{k}={v}" for k, v in (sweep.get("server_env") or {}).items())
    lines = [
        f"# {sweep.get('title') or 'specserve bench sweep'}",
        "",
        "Reproduce (from the repository root):",
        "",
        "```bash",
        sweep.get("command") or "specserve bench sweep",
        "```",
        "",
        f"Machine: {m.get('cpu')}, {m.get('cpu_count')} CPUs, {m.get('system')}, "
        f"Python {m.get('python')}, torch {m.get('torch')}, GPU: {m.get('gpu') or 'none'}.",
        "",
    ]
    rounds = sweep.get("rounds") or 1
    if rounds > 1:
        lines += [
            f"Server configurations (side by side, {rounds} rounds: at each concurrency every "
            "configuration in turn, the order rotated each round):",
            "",
        ]
    else:
        lines += ["Server configurations (one server at a time):", ""]
    lines += []
    for name, flags in sweep["configs"].items():
        cmd = shlex.join(["specserve", "serve", *sweep.get("server_args", []), *flags])
        lines.append(f"- `{name}`: `{(env + ' ') if env else ''}{cmd}`")
    plotted = "the median round of each point" if rounds > 1 else "each run"
    lines += [
        "",
        f"![output throughput, p50 ITL and p50 TPOT against concurrency ({plotted})]({stem}.png)",
        "",
    ]
    if sweep.get("summary"):
        lines += [medians_table(sweep["summary"]), ""]
    lines += [
        markdown_table(sweep["results"]),
        _COLUMNS,
        "",
    ]
    return "\n".join(lines)


def write_outputs(sweep: dict, out_dir: Path, stem: str) -> dict[str, Path]:
    """<stem>.json, <stem>.md (the page with the table) and <stem>.png in out_dir."""
    from specserve.bench.plot import plot_rows

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": save_json(sweep, out_dir / f"{stem}.json")}
    page = out_dir / f"{stem}.md"
    page.write_text(markdown_report(sweep, stem))
    paths["markdown"] = page
    rows = sweep["results"]
    if (sweep.get("rounds") or 1) > 1:
        rows = median_rows(rows)
    paths["png"] = plot_rows(rows, out_dir / f"{stem}.png", title=sweep.get("title"))
    return paths
