"""`specserve bench throughput`: offline throughput, as `vllm bench throughput` measures it.

The engine is built in this process through the `LLM` API (every engine flag of `serve`
works), a few short requests warm it up untimed, then every request is submitted at once:
random prompts of exactly `input_len` token ids (a seeded draw from the tokenizer's
non-special ids, so no detokenize/re-encode drift), `output_len` max_tokens, EOS ignored by
default, greedy by default. Reported: requests/s, output tokens/s, total (prompt + output)
tokens/s, the elapsed seconds, speculation figures of the requests and the engine's own
counters over the timed run (steps, preemptions, draft lengths, steps by kind).

With `--request-rate`, requests arrive instead as `bench serve` sends them to a server: a
Poisson process by the clock (the first at once, then exponential gaps from the seed), each
handed to the engine at the first step boundary after its arrival, and the report adds each
request's latencies (end to end, TTFT, time per output token after the first). The same
flags and rate through `specserve serve` + `bench serve --request-rate` tell what the server
adds to the engine's time (IPC, the HTTP process, tokenization and streaming).
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass

from specserve.core.errors import SpecserveError

# engine.stats() counters that only grow: the timed run's figure is after - before.
_COUNTERS = (
    "steps",
    "preemptions",
    "loop_waits",
    "loop_wait_reasons",
    "spec_steps_by_draft_len",
    "spec_steps_by_step_k",
    "spec_probe_steps",
    "spec_switches",
    "spec_k_changes",
    "spec_position_drafted",
    "spec_position_accepted",
    "steps_by_kind",
    "step_ms_by_kind",
)


@dataclass
class ThroughputWorkload:
    """What to generate: num_prompts random prompts of input_len tokens, output_len each."""

    num_prompts: int = 100
    input_len: int = 256
    output_len: int = 128
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 0
    warmup_requests: int = 4
    request_rate: float = math.inf  # Poisson arrivals, requests/s (inf: all at once)

    def __post_init__(self) -> None:
        if min(self.num_prompts, self.input_len, self.output_len) < 1:
            raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
        if self.warmup_requests < 0:
            raise ValueError(f"--num-warmup must be >= 0; got {self.warmup_requests}")
        if not self.request_rate > 0:  # (NaN too)
            raise ValueError(f"--request-rate must be > 0; got {self.request_rate}")


def prompt_token_ids(tokenizer, vocab_size: int) -> list[int]:
    """Ids a random prompt may hold: the tokenizer's, inside the model's vocabulary, no
    special tokens (an EOS or chat marker mid-prompt is not a workload anyone sends)."""
    if tokenizer is None:  # a prebuilt model without one: any id of the vocabulary
        return list(range(vocab_size))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [i for i in range(min(len(tokenizer), vocab_size)) if i not in special]
    return ids or list(range(vocab_size))


def random_prompts(n: int, input_len: int, vocab: list[int], seed: int) -> list[list[int]]:
    """n prompts of exactly input_len token ids, the same for the same seed."""
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(input_len)] for _ in range(n)]


def _delta(before, after):
    if isinstance(after, dict):
        return {k: _delta((before or {}).get(k, 0), v) for k, v in after.items()}
    if isinstance(after, list):
        before = list(before or [])
        return [a - (before[i] if i < len(before) else 0) for i, a in enumerate(after)]
    return after - (before or 0)


def engine_counts(before: dict, after: dict) -> dict:
    """The engine's counters over the timed run, and each kind of step's mean time (ms:
    device spans on CUDA, host time elsewhere)."""
    counts = {k: _delta(before.get(k), after[k]) for k in _COUNTERS if k in after}
    kinds, ms = counts.get("steps_by_kind") or {}, counts.get("step_ms_by_kind") or {}
    if any(kinds.values()):
        counts["steps_by_kind"] = {k: n for k, n in sorted(kinds.items()) if n}
        counts["step_ms_by_kind_mean"] = {k: ms[k] / n for k, n in counts["steps_by_kind"].items()}
    return counts


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """When each of n requests arrives (seconds from the start): the first at once, then
    exponential gaps at `rate` per second from `seed` (`bench serve`'s schedule); all at
    once for an infinite rate."""
    if not math.isfinite(rate):
        return [0.0] * n
    rng, t, times = random.Random(seed), 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


def run_arrivals(engine, prompts: list[list[int]], params, arrivals: list[float]) -> dict:
    """Hand each prompt to the engine at the first step boundary after its arrival and step
    while anything runs (idle until the next arrival otherwise); returns each request's
    output and latencies (seconds from its arrival: to its first token, to its end, each
    stamped when the step() that returned it does: under overlap scheduling that call has
    launched the next step too, as the server's engine loop has before it sends them) and
    when each was handed over."""
    outputs, first_s, end_s, start_of = {}, {}, {}, {}
    order, handed = [], []  # request ids in arrival order; when each was handed over (s)
    i, n = 0, len(prompts)
    start = time.perf_counter()
    while i < n or engine.has_unfinished():
        now = time.perf_counter() - start
        while i < n and arrivals[i] <= now:
            rid = engine.add_request(prompts[i], params)
            start_of[rid] = arrivals[i]
            order.append(rid)
            handed.append(time.perf_counter() - start)
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[i] - now))
            continue
        step_outputs = engine.step()
        now = time.perf_counter() - start
        for o in step_outputs:
            if o.token_ids and o.request_id not in first_s:
                first_s[o.request_id] = now - start_of[o.request_id]
            if o.finished:
                end_s[o.request_id] = now - start_of[o.request_id]
                outputs[o.request_id] = o
    elapsed = time.perf_counter() - start
    return {
        "elapsed_s": elapsed,
        "handed_s": handed,
        "outputs": [outputs[r] for r in order],
        "ttft_s": [first_s[r] for r in order],
        "e2e_s": [end_s[r] for r in order],
    }


def speculation_of(outputs) -> dict | None:
    """Drafted and accepted tokens of the requests, the acceptance rate and mean acceptance
    length (tokens per verify step, bonus included); None without speculation."""
    stats = [o.spec_stats for o in outputs if o.spec_stats is not None]
    if not stats:
        return None
    drafted = sum(s.drafted for s in stats)
    accepted = sum(s.accepted for s in stats)
    verify_steps = sum(s.verify_steps for s in stats)
    return {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "verify_steps": verify_steps,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": (accepted + verify_steps) / verify_steps
        if verify_steps
        else None,
    }


def run_throughput(llm, work: ThroughputWorkload, progress: bool = False) -> dict:
    """Warm up, then time every request submitted at once; returns the report's numbers."""
    from specserve.core.sampling_params import SamplingParams

    engine = llm.engine
    context = engine.max_model_len
    if work.input_len + work.output_len > context:  # (requests cut short skew the figures)
        raise SpecserveError(
            f"--input-len {work.input_len} + --output-len {work.output_len} exceeds the "
            f"model's context of {context} tokens: requests would end early; lower them "
            "(or --max-model-len up to the model's positions)"
        )
    vocab = prompt_token_ids(llm.tokenizer, engine.model_config.vocab_size)
    if work.warmup_requests:
        warm = random_prompts(work.warmup_requests, min(work.input_len, 16), vocab, work.seed + 1)
        llm.generate(
            warm,
            SamplingParams(
                max_tokens=min(work.output_len, 8), temperature=work.temperature, ignore_eos=True
            ),
        )
    prompts = random_prompts(work.num_prompts, work.input_len, vocab, work.seed)
    params = SamplingParams(
        max_tokens=work.output_len, temperature=work.temperature, ignore_eos=work.ignore_eos
    )
    from specserve.bench.report import latency_stats_ms

    before = engine.stats()
    latency = None
    if math.isfinite(work.request_rate):
        arrivals = arrival_times(work.num_prompts, work.request_rate, work.seed)
        run = run_arrivals(engine, prompts, params, arrivals)
        outputs, elapsed_s = run["outputs"], run["elapsed_s"]
        tpot = [
            (e2e - ttft) / (len(o.token_ids) - 1)
            for o, e2e, ttft in zip(outputs, run["e2e_s"], run["ttft_s"])
            if len(o.token_ids) > 1
        ]
        handed = run["handed_s"]
        span = handed[-1] - handed[0]
        latency = {  # (the rate achieved: requests handed over per second)
            "arrival_rate": (len(handed) - 1) / span if span > 0 else None,
            "e2e_latency_ms": latency_stats_ms(run["e2e_s"]),
            "ttft_ms": latency_stats_ms(run["ttft_s"]),
            "tpot_ms": latency_stats_ms(tpot),
        }
    else:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=progress)
        elapsed_s = time.perf_counter() - start
    after = engine.stats()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    return {
        **({"latency": latency} if latency else {}),
        "elapsed_s": elapsed_s,
        "num_requests": len(outputs),
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_s": len(outputs) / elapsed_s,
        "output_tokens_per_s": output_tokens / elapsed_s,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed_s,
        "finish_reasons": dict(Counter(o.finish_reason for o in outputs)),
        "speculation": speculation_of(outputs),
        "engine_counts": engine_counts(before, after),
        "engine_stats_end": after,
    }


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    """Every engine flag (as `serve` has them) plus the workload's."""
    from specserve.engine_args import add_engine_args

    add_engine_args(p)  # --seed is the engine's and seeds the prompts too
    p.add_argument("--num-prompts", type=int, default=ThroughputWorkload.num_prompts)
    p.add_argument(
        "--input-len",
        type=int,
        default=ThroughputWorkload.input_len,
        help="prompt tokens (random token ids)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=ThroughputWorkload.output_len,
        help="max_tokens of each request",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals at this many requests/s, as `bench serve` sends them (default "
        "inf: every request at once); adds each request's latencies to the report",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate output-len tokens whatever the model says (default on)",
    )
    p.add_argument(
        "--num-warmup",
        type=int,
        default=ThroughputWorkload.warmup_requests,
        help="short untimed requests first",
    )
    p.add_argument("--save-result", help="write the report as JSON to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


_ROWS = (
    ("requests", "num_requests", "{:,}"),
    ("elapsed (s)", "elapsed_s", "{:.2f}"),
    ("prompt tokens", "total_prompt_tokens", "{:,}"),
    ("output tokens", "total_output_tokens", "{:,}"),
    ("requests/s", "requests_per_s", "{:.3f}"),
    ("output tokens/s", "output_tokens_per_s", "{:,.1f}"),
    ("total tokens/s", "total_tokens_per_s", "{:,.1f}"),
)


_QUANTILES = ("mean", "p50", "p90", "p99")


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"specserve bench throughput: {report['model']}", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for label, key, fmt in _ROWS:
        table.add_row(label, fmt.format(report[key]))
    latency = report.get("latency")
    if latency:
        table.add_row("arrival rate (req/s)", f"{latency['arrival_rate'] or 0:.3f}")
        for key in ("e2e_latency_ms", "ttft_ms", "tpot_ms"):
            s = latency[key]
            label = key.removesuffix("_ms").replace("_latency", "").upper()
            table.add_row(
                f"{label} mean / p50 / p90 / p99 (ms)",
                " / ".join("-" if s[q] is None else f"{s[q]:,.1f}" for q in _QUANTILES),
            )
    counts = report["engine_counts"]
    for key in ("steps", "preemptions", "spec_steps_by_draft_len"):
        if key in counts:
            table.add_row(f"engine: {key.replace('_', ' ')}", str(counts[key]))
    if counts.get("steps_by_kind"):
        from specserve.bench.report import step_kinds

        table.add_row("engine: mean device ms by step kind (steps)", step_kinds(counts))
    for key, value in (report["speculation"] or {}).items():
        table.add_row(
            f"spec: {key.replace('_', ' ')}",
            "-" if value is None else f"{value:,.3f}".rstrip("0").rstrip("."),
        )
    Console().print(table)


def throughput_command(args: argparse.Namespace) -> int:
    """Build the engine from the flags, run the workload, print and save the report."""
    from specserve.bench.report import save_json
    from specserve.bench.sweep import machine_info
    from specserve.engine_args import engine_config
    from specserve.llm import LLM

    try:
        work = ThroughputWorkload(
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.temperature,
            args.ignore_eos,
            args.seed,
            args.num_warmup,
            args.request_rate,
        )
        cfg = engine_config(args)
    except ValueError as e:
        raise SpecserveError(str(e)) from e
    llm = LLM(progress=not args.no_progress, **cfg.flags())
    source = llm.engine.source
    report = {
        "kind": "specserve-bench-throughput",
        "model": source.path.name if source is not None else str(cfg.load.model),
        "workload": asdict(work),
        "engine_config": llm.engine.config.flags(),
        "machine": machine_info(),
        **run_throughput(llm, work, progress=not args.no_progress),
    }
    _print(report)
    if args.save_result:
        print(f"saved {save_json(report, args.save_result)}")
    return 0
