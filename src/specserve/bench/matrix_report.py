"""The matrix's results as ratios, for the claim that the goodput policy is never slower than
plain decoding or the best fixed K: per (acceptance, arrival, level) point, goodput's
figure over the best of off and every fixed K, and over off; then the JSON, the markdown
page (a table per acceptance) and the plot of goodput ÷ best.

The figure is output token throughput in a closed loop. Under Poisson arrivals it is mean
end-to-end latency (a ratio of the best's latency to goodput's, so above 1 is still
better): below saturation every configuration's throughput is the arrival rate times the
tokens a request, and a twice slower configuration moved it by a few percent."""

from __future__ import annotations

import shlex
import statistics
from pathlib import Path

from specserve.bench.matrix import Point
from specserve.bench.report import save_json, step_kinds, step_ms_by_k

_UNITS = {"closed": "concurrency", "poisson": "req/s"}


def _complete(row: dict) -> bool:
    return row["completed"] == row["num_requests"]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _latency(row: dict) -> float | None:
    return (row.get("e2e_latency_ms") or {}).get("mean")


def point_ratios(rows: list[dict], acceptances: list[float]) -> list[dict]:
    """One entry per (acceptance, arrival, level) where any configuration ran: output tok/s
    by configuration (off's row serves every acceptance) and, under Poisson arrivals, mean
    end-to-end latency; the best baseline among off and the fixed Ks by the point's figure
    (the module docstring), goodput ÷ best and goodput ÷ off (None when a side is
    missing); whether every run completed every request, and how far the runs' output
    token totals are apart (they differ where EOS ends requests and simulated acceptance
    changed the tokens: throughputs of different work)."""
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
            goodput = next((r for r in here if r["matrix"]["policy"] == "goodput"), None)
            fraction = next((r["matrix"].get("rate_fraction") for r in here), None)
            entry = {
                "acceptance": acceptance,
                "arrival": arrival,
                "level": level,
                "rate_fraction": fraction,
                "output_throughput": tput,
            }
            if arrival == "poisson":  # lower is better: the best is the lowest
                figure = {r["matrix"]["config"]: _latency(r) for r in here}
                entry["e2e_latency_ms_mean"] = figure
                entry["ratio_of"] = "e2e_latency_ms_mean"
                better = min
                over = lambda a, b: _ratio(b, a)  # noqa: E731 (best's latency ÷ goodput's)
            else:
                figure, better, over = tput, max, _ratio
                entry["ratio_of"] = "output_throughput"
            baselines = {
                r["matrix"]["config"]: figure[r["matrix"]["config"]]
                for r in here
                if r["matrix"]["policy"] in ("off", "fixed")
                and figure[r["matrix"]["config"]] is not None
            }
            best = better(baselines, key=baselines.get) if baselines else None
            mine_figure = figure.get("goodput") if goodput else None
            totals = [r["total_output_tokens"] for r in here if r.get("total_output_tokens")]
            entry.update(
                best_baseline=best,
                goodput_over_best=over(mine_figure, baselines.get(best)),
                goodput_over_off=over(mine_figure, figure.get("off")),
                all_requests_ok=all(_complete(r) for r in here),
                output_tokens_spread=max(totals) / min(totals) - 1 if totals else None,
                goodput_speculation=((goodput or {}).get("server") or {}).get("speculation"),
            )
            out.append(entry)
    return out


UNEQUAL_WORK = 0.01  # output token totals further apart than this: not the same work


def comparable(r: dict) -> bool:
    """A point whose goodput ÷ best counts: both sides there, every request of every run
    completed (a failed request takes its tokens, not its wait), the same work."""
    spread = r.get("output_tokens_spread")
    return (
        r["goodput_over_best"] is not None
        and r["all_requests_ok"]
        and (spread is None or spread <= UNEQUAL_WORK)
    )


def ratio_summary(ratios: list[dict]) -> str:
    """One line: how many points goodput ÷ best falls below 1 at, its minimum and median,
    over the comparable points (and how many were not)."""
    values = [r for r in ratios if comparable(r)]
    left_out = sum(r["goodput_over_best"] is not None for r in ratios) - len(values)
    note = (
        f" ({left_out} more left out: failed requests or unequal output token totals)"
        if left_out
        else ""
    )
    if not values:
        return "goodput ÷ best: no comparable point has both goodput and a baseline" + note
    low = min(values, key=lambda r: r["goodput_over_best"])
    below = sum(r["goodput_over_best"] < 1.0 for r in values)
    median = statistics.median(r["goodput_over_best"] for r in values)
    return (
        f"goodput ÷ best: below 1.00 at {below} of {len(values)} points; minimum "
        f"{low['goodput_over_best']:.3f} ({_point(low).label}), median {median:.3f}" + note
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
        latency = r.get("e2e_latency_ms_mean") or {}
        tput = [
            (f"{r['output_throughput'][c]:.1f}" if c in r["output_throughput"] else "-")
            + (f" ({latency[c]:.0f} ms)" if latency.get(c) is not None else "")
            for c in configs
        ]
        spec = r.get("goodput_speculation") or {}
        accept = spec.get("mean_acceptance_length")
        flag = "" if r["all_requests_ok"] else " (errors)"
        spread = r.get("output_tokens_spread")
        if spread is not None and spread > UNEQUAL_WORK:
            flag += f" (output tokens {spread:.0%} apart)"
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
        if step_kinds(server):  # decode-only or carrying prefill, by K: mean ms (steps)
            step += f" [device by kind: {step_kinds(server)}]"
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
        "are of output token throughput in a closed loop and of mean end-to-end latency "
        "under Poisson arrivals (the best's over goodput's: above 1 is better either way); "
        "points with failed requests or unequal output token totals are flagged and left "
        "out of the summary and the plot.",
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
            "Output tok/s by configuration (Poisson points: and mean end-to-end latency, "
            "which their ratios compare):",
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
