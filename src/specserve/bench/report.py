"""Turns request results into the benchmark report: throughput, latency percentiles, errors
by kind, the prefix cache's share of the prompt tokens (where the server reports cached
tokens), figures by conversation turn (multi-turn runs) and the server's own counts; prints
it as a table and saves it as JSON."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from specserve.bench.load import RequestResult
from specserve.speculative.buckets import batch_bucket

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms")


def latency_stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """Mean and percentiles (PERCENTILES) in ms of latencies in seconds; None without any."""
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    out = {"mean": float(ms.mean())}
    out.update({f"p{q}": float(np.percentile(ms, q)) for q in PERCENTILES})
    return out


def _tokens_per_chunk(ok: list[RequestResult]) -> float | None:
    """Output tokens after the first over the text chunks after the first (summarize)."""
    chunks = sum(len(r.itl_s) for r in ok)
    tokens = sum(r.output_tokens - 1 for r in ok if r.itl_s)
    return tokens / chunks if chunks else None


def _cache_hit_share(ok: list[RequestResult]) -> float | None:
    """Cached prompt tokens ÷ prompt tokens over the requests whose usage reported both; None
    when none did (a server that does not report cached tokens: unknown, not 0)."""
    known = [r for r in ok if r.cached_prompt_tokens is not None and r.prompt_tokens]
    prompt = sum(r.prompt_tokens for r in known)
    return sum(r.cached_prompt_tokens for r in known) / prompt if prompt else None


def _by_turn(results: list[RequestResult]) -> list[dict] | None:
    """Per turn of a multi-turn run (0-based): its completed requests, mean TTFT, mean prompt
    tokens and prefix-cache hit share; None for a run of single requests."""
    if all(r.turn == 0 for r in results):
        return None
    rows = []
    for turn in range(max(r.turn for r in results) + 1):
        ok = [r for r in results if r.ok and r.turn == turn]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        rows.append(
            {
                "turn": turn,
                "completed": len(ok),
                "ttft_ms_mean": float(np.mean(ttfts)) * 1e3 if ttfts else None,
                "prompt_tokens_mean": float(np.mean(prompts)) if prompts else None,
                "prefix_cache_hit_share": _cache_hit_share(ok),
            }
        )
    return rows


def _arrival_rate(results: list[RequestResult]) -> float | None:
    starts = sorted(r.start_s for r in results if r.turn == 0)  # (a conversation: its first)
    span = starts[-1] - starts[0] if len(starts) > 1 else 0.0
    return (len(starts) - 1) / span if span > 0 else None


def summarize(
    results: list[RequestResult], duration_s: float, server: dict | None = None, **context
) -> dict:
    """The report as a JSON-ready dict. `context` (config, dataset...) is stored as given."""
    ok = [r for r in results if r.ok]
    errors = Counter(r.error for r in results if not r.ok)
    examples = {}
    for r in results:
        if not r.ok and r.error not in examples:
            examples[r.error] = r.error_message
    # (unknown, not 0, where a server's usage did not say: its prompts were not counted)
    prompt_counts = [r.prompt_tokens for r in ok]
    input_tokens = sum(prompt_counts) if None not in prompt_counts else None
    cached = [r.cached_prompt_tokens for r in ok if r.cached_prompt_tokens is not None]
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    report = {
        **context,
        "duration_s": duration_s,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(errors.most_common()),
        "error_examples": examples,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "token_counts_from_usage": bool(ok) and all(r.usage_reported for r in ok),
        # usage.prompt_tokens_details.cached_tokens, where the server reports it
        "cached_tokens_reported": len(cached),
        "total_cached_prompt_tokens": sum(cached) if cached else None,
        "prefix_cache_hit_share": _cache_hit_share(ok),
        # requests sent per second, first to last (a Poisson point's offered load as the
        # client achieved it; None below two requests)
        "arrival_rate": _arrival_rate(results),
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": (
            per_s(input_tokens + output_tokens) if input_tokens is not None else None
        ),
        "ttft_ms": latency_stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": latency_stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": latency_stats_ms([x for r in ok for x in r.itl_s]),
        "e2e_latency_ms": latency_stats_ms([r.latency_s for r in ok]),
        # (Output tokens - 1) per streamed text chunk after the first: not tokens per decode
        # step, for a server sends no chunk for a step whose text it holds back (a partial
        # UTF-8 character, a special token), whose tokens count in the next chunk; it reads
        # above 1 without speculation: an upper bound on mean tokens per decode step.
        "tokens_per_chunk": _tokens_per_chunk(ok),
        "by_turn": _by_turn(results),
        "server": server,
    }
    return report


def _fmt(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return f"{x:,}"


def report_rows(report: dict) -> list[tuple[str, str]]:
    """(label, value) rows of the end-of-run table."""
    rows = [
        ("requests completed / sent", f"{report['completed']} / {report['num_requests']}"),
        ("duration (s)", _fmt(report["duration_s"])),
        ("input tokens", _fmt(report["total_input_tokens"])),
        ("output tokens", _fmt(report["total_output_tokens"])),
        ("request throughput (req/s)", _fmt(report["request_throughput"], 3)),
        ("output throughput (tok/s)", _fmt(report["output_throughput"])),
        ("total throughput (tok/s)", _fmt(report["total_token_throughput"])),
    ]
    for key in LATENCIES:
        s = report[key]
        label = key.removesuffix("_ms").replace("_", " ").upper().replace("E2E LATENCY", "E2E")
        rows.append(
            (
                f"{label} mean / p50 / p90 / p99 (ms)",
                " / ".join(_fmt(s[k], 1) for k in ("mean", "p50", "p90", "p99")),
            )
        )
    rows.append(("tokens per text chunk (not per step)", _fmt(report.get("tokens_per_chunk"), 2)))
    rows += _cache_rows(report)
    for kind, n in report["errors"].items():
        rows.append((f"errors: {kind}", str(n)))
    server = report.get("server") or {}
    if server:
        by_status = ", ".join(f"{k}: {v}" for k, v in server.get("requests_by_status", {}).items())
        rows.append(("server: API requests by status", by_status or "-"))
        for key in ("prompt_tokens", "generation_tokens", "engine_steps", "preemptions"):
            if key in server:
                rows.append((f"server: {key.replace('_', ' ')}", _fmt(server[key])))
        if step_kinds(server):
            rows.append(("server: mean device ms by step kind (steps)", step_kinds(server)))
    spec = server.get("speculation") or {}
    if spec.get("policy"):
        rows.append(("spec: policy", spec["policy"]))
    if spec.get("simulated_acceptance"):
        rows.append(("spec: SIMULATED ACCEPTANCE", "outputs are not the model's"))
    for key in ("draft_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length"):
        if key in spec:
            rows.append((f"spec: {key.replace('_', ' ')}", _fmt(spec[key], 3)))
    if spec.get("draft_length_mix"):
        mix = ", ".join(f"K={k}: {v:.0%}" for k, v in spec["draft_length_mix"].items())
        rows.append(("spec: draft-length mix", mix))
    if spec.get("acceptance_by_position"):
        rates = ", ".join(f"{v:.2f}" for v in spec["acceptance_by_position"].values())
        rows.append(("spec: acceptance by position", rates))
    if spec.get("step_ms_by_k"):
        rows.append(("spec: mean step ms by K", step_ms_by_k(spec)))
    if spec.get("settled_steps"):
        rows.append(("spec: steps not deliberated (settled)", _fmt(spec["settled_steps"])))
    return rows


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _cache_rows(report: dict) -> list[tuple[str, str]]:
    """The prefix cache's hit share when the server reported cached tokens, and a multi-turn
    run's figures by turn."""
    rows = []
    share = report.get("prefix_cache_hit_share")
    if share is not None:
        reported, completed = report["cached_tokens_reported"], report["completed"]
        value = f"{_share(share)} ({_fmt(report['total_cached_prompt_tokens'])} tokens)"
        if reported < completed:
            value += f", reported by {reported} of {completed} requests"
        rows.append(("prefix cache hit share", value))
    for t in report.get("by_turn") or []:
        rows.append(
            (
                f"turn {t['turn'] + 1}: TTFT mean (ms) / prompt tokens / cache hit",
                f"{_fmt(t['ttft_ms_mean'], 1)} / {_fmt(t['prompt_tokens_mean'], 0)}"
                f" / {_share(t['prefix_cache_hit_share'])}",
            )
        )
    return rows


def step_kinds(steps: dict) -> str:
    """The server's mean step time by kind with the step count ("decode K=1 8.86 (1916),
    prefill K=1 16.22 (302)"; metrics_client.step_figures): device spans on a GPU server
    (not periods: they do not add up to the mean step), or "" when it reported none."""
    counts = steps.get("steps_by_kind") or {}
    means = steps.get("step_ms_by_kind_mean") or {}
    return ", ".join(f"{kind} {means.get(kind, 0.0):.2f} ({n})" for kind, n in counts.items())


def step_ms_by_k(spec: dict) -> str:
    """A speculating server's mean step period at each K it ran ("K=0 0.85, K=3 1.70"), with
    its device span where the server timed one ("K=0 0.85 (device 0.80), ..."), then its plain
    steps with the drafter dormant and with prefill apart ("; K=0 dormant 0.80, with prefill
    1.60"), or "" when it reported none."""
    device = spec.get("device_ms_by_k") or {}
    text = ", ".join(
        f"K={k} {ms:.2f}" + (f" (device {device[k]:.2f})" if k in device else "")
        for k, ms in (spec.get("step_ms_by_k") or {}).items()
    )
    parts = spec.get("plain_step_ms_by_part") or {}
    part_device = spec.get("plain_device_ms_by_part") or {}
    if parts:  # "; K=0 dormant 0.98 (device 0.90), with prefill 1.60"
        text += "; K=0 " + ", ".join(
            f"{_PART_NAMES.get(part, part)} {ms:.2f}"
            + (f" (device {part_device[part]:.2f})" if part in part_device else "")
            for part, ms in parts.items()
        )
    return text


_PART_NAMES = {"prefill": "with prefill"}


def policy_table(spec: dict, concurrency: int | None) -> str:
    """The goodput policy's tables at the batch bucket of `concurrency` as of a point's end
    (metrics_client: `policy_tables`): its steady period at each K and the modes' factors
    ("policy at 64: K=0 1.50, K=3 3.40 ms; plain x0.95, drafting x1.02"), and what its last
    decode-only decision there expected a request to commit at each K in the period it ranked
    K by ("; last expected a request: K=0 1.00 in 2.10 ms, K=3 2.60 in 4.00 ms"), and what
    it priced steps carrying prefill by ("; beside prefill: surcharge 4.20 ms, 9.1 tokens a
    ms": `policy_scalars`), or "" when the server exported none (other policies, other
    servers). Without a concurrency (arrivals at a rate), at the bucket with the most
    observations."""
    tables = spec.get("policy_tables") or {}
    if concurrency:
        bucket = str(batch_bucket(concurrency))
    else:
        seen = tables.get("period_observations") or {}
        bucket = max(seen, key=lambda b: sum(seen[b].values()), default="")
    periods = (tables.get("period_ms") or {}).get(bucket)
    if not periods:
        return ""
    text = f"policy at {bucket}: " + ", ".join(
        f"K={k} {ms:.2f}" for k, ms in sorted(periods.items(), key=lambda kv: int(kv[0]))
    )
    factors = (tables.get("mode_factor") or {}).get(bucket)
    if factors:
        text += " ms; " + ", ".join(f"{m} x{f:.2f}" for m, f in sorted(factors.items()))
    tokens = (tables.get("expected_tokens") or {}).get(bucket)
    ranked = (tables.get("expected_period_ms") or {}).get(bucket) or {}
    if tokens:
        text += "; last expected a request: " + ", ".join(
            f"K={k} {t:.2f} in {ranked[k]:.2f} ms"
            for k, t in sorted(tokens.items(), key=lambda kv: int(kv[0]))
            if k in ranked
        )
    scalars = spec.get("policy_scalars") or {}
    surcharge = scalars.get("prefill_surcharge_ms")
    price = scalars.get("prefill_price_tokens_per_second")
    if surcharge is not None and price is not None:
        text += f"; beside prefill: surcharge {surcharge:.2f} ms"
        upkeep = scalars.get("prefill_upkeep_ms")
        if upkeep is not None:
            text += f", the drafter's upkeep {upkeep:.2f} ms"
        text += f", {price / 1e3:.1f} tokens a ms"
    return text


def print_report(report: dict, title: str = "specserve bench") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for label, value in report_rows(report):
        table.add_row(label, value)
    console = Console()
    console.print(table)
    for note in (report.get("dataset") or {}).get("notes", []):
        console.print(f"note: {note}")


def save_json(obj: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")
    return path
