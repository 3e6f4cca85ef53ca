"""What the rounds of a side-by-side sweep (`bench sweep --rounds`) sum up to: each point's
median and range over the rounds, its ratio to a reference configuration taken within each
round (runs seconds apart: a slow stretch of the host falls on both), the median round of
each point for the plot, and the table of it all."""

from __future__ import annotations

import statistics
from collections import defaultdict


def round_medians(rows: list[dict], reference: str | None = None) -> list[dict]:
    """Per (configuration, concurrency), over the rounds of a side-by-side sweep: the median
    output throughput, its lowest and highest, and with `reference` (a configuration's name)
    `ratio_to`: the median over rounds of this configuration's throughput over the
    reference's at the same concurrency in the same round (paired, see the module
    docstring). Rounds where a run had failed requests count in neither."""
    by_point: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    for r in rows:
        if r["failed"]:
            continue
        key = (r["label"], r["config"]["max_concurrency"])
        by_point[key][r.get("round", 0)] = r["output_throughput"]
    out = []
    for (label, c), tput in by_point.items():
        values = list(tput.values())
        entry = {
            "config": label,
            "concurrency": c,
            "rounds": len(values),
            "output_throughput_median": statistics.median(values),
            "output_throughput_min": min(values),
            "output_throughput_max": max(values),
        }
        ref = by_point.get((reference, c), {}) if reference is not None else {}
        ratios = [v / ref[rnd] for rnd, v in tput.items() if ref.get(rnd)]
        if reference is not None:
            entry["reference"] = reference
            entry["ratio_to"] = statistics.median(ratios) if ratios else None
        out.append(entry)
    return out


def median_rows(rows: list[dict]) -> list[dict]:
    """One report per (configuration, concurrency): the round whose output throughput is the
    median (the lower of the middle two for an even count) among the rounds without failed
    requests (among all, if every round had some), for plotting."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["label"], r["config"]["max_concurrency"])].append(r)
    out = []
    for group in groups.values():
        clean = [r for r in group if not r["failed"]] or group
        ranked = sorted(clean, key=lambda r: r["output_throughput"])
        out.append(ranked[(len(ranked) - 1) // 2])
    return out


def medians_table(summary: list[dict]) -> str:
    """`round_medians` as a markdown table."""
    reference = next((e["reference"] for e in summary if "reference" in e), None)
    head = "| config | concurrency | rounds | output tok/s median | lowest – highest |"
    if reference is not None:
        head += f" ÷ {reference} (median of rounds) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for e in summary:
        line = (
            f"| {e['config']} | {e['concurrency']} | {e['rounds']} | "
            f"{e['output_throughput_median']:.1f} | {e['output_throughput_min']:.1f} – "
            f"{e['output_throughput_max']:.1f} |"
        )
        if reference is not None:
            ratio = e.get("ratio_to")
            line += " - |" if ratio is None else f" {ratio:.3f} |"
        lines.append(line)
    return "\n".join(lines) + "\n"
