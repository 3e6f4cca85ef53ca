"""The matrix's results as ratios, for the claim that the goodput policy is never slower than
plain decoding or the best fixed K: per (acceptance, arrival, level) point, goodput's output
token throughput over the best of off and every fixed K, and over off; then the JSON, the
markdown page (a table per acceptance) and the plot of goodput ÷ best."""

from __future__ import annotations

import shlex
import statistics
from pathlib import Path

from specserve.bench.matrix import Point
from specserve.bench.report import save_json, step_ms_by_k

_UNITS = {"closed": "concurrency", "poisson": "req/s"}


def _complete(row: dict) -> bool:
    return row["completed"] == row["num_requests"]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def point_ratios(rows: list[dict], acceptances: list[float]) -> list[dict]:
    """One entry per (acceptance, arrival, level) where any configuration ran: output tok/s
    by configuration (off's row serves every acceptance), the best baseline among off and
    the fixed Ks, goodput ÷ best and goodput ÷ off (None when a side is missing)."""
    off = {
        (r["matrix"]["arrival"], r["matrix"]["level"]): r
        for r in rows
        if r["matrix"]["policy"] == "off"
    }
    out = []
    for acceptance in acceptances:
        mine = [r for r in rows if r["matrix"]["acceptance"] == acceptance]
        points = sorted(
            {(r["matrix"]["arrival"], r["matrix"]["level"]) for r in mine} | set(off),
            key=lambda p: (p[0] != "closed", p[1]),
        )
        for arrival, level in points:
            here = [
                r
                for r in mine
                if (r["matrix"]["arrival"], r["matrix"]["level"]) == (arrival, level)
            ]
            if (arrival, level) in off:
                here.insert(0, off[(arrival, level)])
            tput = {r["matrix"]["config"]: r["output_throughput"] for r in here}
            baselines = {
                r["matrix"]["config"]: r["output_throughput"]
                for r in here
                if r["matrix"]["policy"] in ("off", "fixed")
            }
            best = max(baselines, key=baselines.get) if baselines else None
            goodput = next((r for r in here if r["matrix"]["policy"] == "goodput"), None)
            g_tput = goodput["output_throughput"] if goodput else None
            fraction = next((r["matrix"].get("rate_fraction") for r in here), None)
            out.append(
                {
                    "acceptance": acceptance,
                    "arrival": arrival,
                    "level": level,
                    "rate_fraction": fraction,
                    "output_throughput": tput,
                    "best_baseline": best,
                    "goodput_over_best": _ratio(g_tput, baselines.get(best)),
                    "goodput_over_off": _ratio(g_tput, tput.get("off")),
                    "all_requests_ok": all(_complete(r) for r in here),
                    "goodput_speculation": ((goodput or {}).get("server") or {}).get("speculation"),
                }
            )
    return out


def ratio_summary(ratios: list[dict]) -> str:
    """One line: how many points goodput ÷ best falls below 1 at, its minimum and median."""
    values = [r for r in ratios if r["goodput_over_best"] is not None]
    if not values:
        return "goodput ÷ best: no point has both goodput and a baseline"
    low = min(values, key=lambda r: r["goodput_over_best"])
    below = sum(r["goodput_over_best"] < 1.0 for r in values)
    median = statistics.median(r["goodput_over_best"] for r in values)
    return (
        f"goodput ÷ best: below 1.00 at {below} of {len(values)} points; minimum "
        f"{low['goodput_over_best']:.3f} ({_point(low).label}), median {median:.3f}"
    )


def _point(r: dict) -> Point:
    return Point(r["arrival"], r["level"], r.get("rate_fraction"))


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _mix(spec: dict | None) -> str:
    mix = (spec or {}).get("draft_length_mix") or {}
    return ", ".join(f"{k}:{v:.0%}" for k, v in mix.items()) or "-"


def ratio_table(ratios: list[dict], configs: list[str]) -> str:
    """Markdown: a line per point, output tok/s per configuration, the two ratios, the best
    baseline and goodput's draft-length mix and mean acceptance length from /metrics."""
    head = [
        "arrival",
        "load",
        *configs,
        "goodput ÷ best",
        "goodput ÷ off",
        "best baseline",
        "goodput K mix",
        "goodput accept len",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in ratios:
        tput = [
            f"{r['output_throughput'][c]:.1f}" if c in r["output_throughput"] else "-"
            for c in configs
        ]
        spec = r.get("goodput_speculation") or {}
        accept = spec.get("mean_acceptance_length")
        flag = "" if r["all_requests_ok"] else " (errors)"
        lines.append(
            "| "
            + " | ".join(
                [
                    r["arrival"],
                    _point(r).label + flag,
                    *tput,
                    _x(r["goodput_over_best"]),
                    _x(r["goodput_over_off"]),
                    r["best_baseline"] or "-",
                    _mix(spec),
                    "-" if accept is None else f"{accept:.2f}",
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def detail_table(rows: list[dict]) -> str:
    """Markdown: every run, with latency and what the server's /metrics counted."""
    head = (
        "| config | acceptance | point | requests ok/sent | output tok/s | TTFT p50 ms | "
        "TPOT p50 ms | step ms | waits | accept len | draft-length mix | load 1m |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        m = r["matrix"]
        server = r.get("server") or {}
        spec = server.get("speculation") or {}
        accept = spec.get("mean_acceptance_length")
        load = r.get("load_avg_1m") or [None]
        waits = ", ".join(f"{k} {v}" for k, v in (server.get("loop_wait_reasons") or {}).items())
        step = "-" if "step_ms_mean" not in server else f"{server['step_ms_mean']:.2f}"
        if step_ms_by_k(spec):
            step += f" ({step_ms_by_k(spec)})"
        cells = [
            m["config"],
            "all" if m["acceptance"] is None else f"{m['acceptance']:g}",
            Point(m["arrival"], m["level"], m.get("rate_fraction")).label,
            f"{r['completed']}/{r['num_requests']}",
            f"{r['output_throughput']:.1f}",
            _ms(r["ttft_ms"]["p50"]),
            _ms(r["tpot_ms"]["p50"]),
            step,
            waits or str(server.get("loop_waits", "-")),
            "-" if accept is None else f"{accept:.2f}",
            _mix(spec),
            "-" if None in load else "→".join(f"{x:.1f}" for x in load),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def markdown_page(matrix: dict, stem: str) -> str:
    """The matrix as a page: command, machine, servers, skipped ones, the plot, a ratio table
    per acceptance and every run's details."""
    m = matrix.get("machine") or {}
    spec = matrix["spec"]
    lines = [
        f"# {matrix.get('title') or 'specserve adaptive-speculation matrix'}",
        "",
        "Reproduce (from the repository root):",
        "",
        "```bash",
        matrix.get("command") or "specserve bench sweep --matrix adaptive",
        "```",
        "",
        f"Machine: {m.get('cpu')}, {m.get('cpu_count')} CPUs, {m.get('system')}, "
        f"Python {m.get('python')}, torch {m.get('torch')}, GPU: {m.get('gpu') or 'none'}.",
        "",
        f"Simulated acceptance given to the servers as: {spec['simulate_as']} "
        "(rate: every configuration at an acceptance L drafts with the per-token rate "
        "whose mean acceptance length at goodput's K_max is L; length: each server gets L "
        "at its own K). `off` never drafts: one server serves every acceptance. Ratios "
        "are of output token throughput.",
        "",
        "Servers (one at a time, in this order):",
        "",
    ]
    for s in matrix["servers"]:
        cmd = shlex.join(["specserve", "serve", *matrix.get("server_args", []), *s["flags"]])
        lines.append(f"- `{s['name']}`: `{cmd}`")
    for s in matrix.get("skipped", []):
        lines.append(f"- skipped `{s['config']}` at {s['acceptance']:g}: {s['reason']}")
    lines += ["", f"![goodput ÷ best baseline per point]({stem}.png)", ""]
    order = {"off": 0, "fixed": 1, "goodput": 2}  # columns: off, fixed K ascending, goodput
    ordered = sorted(matrix["servers"], key=lambda s: (order[s["policy"]], s["k"] or 0))
    configs = list(dict.fromkeys(s["config"] for s in ordered))
    for acceptance in spec["acceptance"]:
        here = [r for r in matrix["ratios"] if r["acceptance"] == acceptance]
        ran = [c for c in configs if any(c in r["output_throughput"] for r in here)]
        sim = matrix.get("simulated", {}).get(str(acceptance))
        lines += [
            f"## Acceptance {acceptance:g}"
            + (f" (--speculative-simulate-acceptance {sim})" if sim else ""),
            "",
            ratio_summary(here),
            "",
            "Output tok/s by configuration:",
            "",
            ratio_table(here, ran),
        ]
    lines += ["## Every run", "", detail_table(matrix["results"]), ""]
    return "\n".join(lines)


def write_matrix_outputs(matrix: dict, out_dir: Path, stem: str) -> dict[str, Path]:
    """<stem>.json, <stem>.md and <stem>.png (goodput ÷ best) in out_dir; no PNG, with a
    line saying why, when no point has goodput and a baseline to compare (a run of one
    configuration still keeps its results)."""
    from specserve.bench.plot import PlotError, plot_ratios

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": save_json(matrix, out_dir / f"{stem}.json")}
    page = out_dir / f"{stem}.md"
    page.write_text(markdown_page(matrix, stem))
    paths["markdown"] = page
    try:
        paths["png"] = plot_ratios(
            matrix["ratios"], out_dir / f"{stem}.png", title=matrix.get("title")
        )
    except PlotError as e:
        print(f"[matrix] no plot: {e}")
    return paths
