"""Plots of benchmark results against concurrency, one line per configuration: output
throughput, p50 inter-token latency (per streamed chunk) and p50 time per output token.

Reads sweep JSON (`specserve bench sweep`) and single-run JSON (`specserve bench serve
--save-result`, labelled by its --label or the file name), so separate runs can be drawn on
one figure; a label found in several files is told apart by its file (`load_rows`). The
adaptive-speculation matrix (`bench sweep --matrix`) is drawn as ratios: goodput ÷ the best
baseline per point (`plot_ratios`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

PANELS = (
    ("output_throughput", None, "output throughput (tok/s)"),
    ("itl_ms", "p50", "p50 inter-token latency (ms)"),
    ("tpot_ms", "p50", "p50 time per output token (ms)"),
)


class PlotError(ValueError):
    """A results file the plot cannot read; the message names it."""


def load_rows(paths: list[str | Path]) -> list[dict]:
    """Reports from sweep or single-run JSON files, each with a 'label'; of a sweep of
    several rounds, each point's median round (as the sweep drew it). A label that more
    than one file uses becomes "<file>: <label>" in each (the file's stem, or its path where
    stems repeat): two machines' sweeps of the same configurations are two lines each, not
    one line through both."""
    from specserve.bench.rounds import median_rows

    by_file = []
    for path in map(Path, paths):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PlotError(f"cannot read results {str(path)!r}: {e}") from e
        if isinstance(data, dict) and isinstance(data.get("results"), list):
            results = data["results"]
            rows = median_rows(results) if (data.get("rounds") or 1) > 1 else results
        elif isinstance(data, dict) and "output_throughput" in data:
            rows = [{**data, "label": data.get("label") or path.stem}]
        else:
            raise PlotError(f"{str(path)!r} is neither a sweep nor a bench result file")
        by_file.append((path, rows))
    files_of: dict[str, set[Path]] = defaultdict(set)
    for path, rows in by_file:
        for row in rows:
            files_of[row.get("label")].add(path)
    stems = [path.stem for path, _ in by_file]
    named = {path: path.stem if stems.count(path.stem) == 1 else str(path) for path, _ in by_file}
    return [
        {**row, "label": f"{named[path]}: {row.get('label')}"}
        if len(files_of[row.get("label")]) > 1
        else row
        for path, rows in by_file
        for row in rows
    ]


def _value(row: dict, key: str, stat: str | None) -> float | None:
    v = row.get(key)
    return v.get(stat) if stat and isinstance(v, dict) else v


def plot_rows(rows: list[dict], out_path: str | Path, title: str | None = None) -> Path:
    """Draw the panels for these reports into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if (row.get("config") or {}).get("max_concurrency") is None:
            raise PlotError(f"result '{row.get('label')}' has no max_concurrency to plot against")
        series[row["label"]].append(row)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.2 * len(PANELS), 4.2))
    levels = sorted({r["config"]["max_concurrency"] for r in rows})
    for ax, (key, stat, ylabel) in zip(axes, PANELS):
        for label, points in series.items():
            points = sorted(points, key=lambda r: r["config"]["max_concurrency"])
            xs = [p["config"]["max_concurrency"] for p in points]
            ys = [_value(p, key, stat) for p in points]
            ys = [float("nan") if y is None else y for y in ys]
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    return _save(fig, out_path, title)


def plot_ratios(ratios: list[dict], out_path: str | Path, title: str | None = None) -> Path:
    """The adaptive-speculation matrix: goodput ÷ the best of off and fixed K at every
    comparable point (matrix_report.py: by throughput, under Poisson by latency), a panel
    per arrival (closed: against concurrency; Poisson: against the request rate), a line
    per acceptance; the dashed line at 1 is where goodput matches the best."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specserve.bench.matrix_report import comparable

    points = [r for r in ratios if comparable(r)]  # (failed requests, unequal work: not drawn)
    if not points:
        raise PlotError("no comparable point has both a goodput and a baseline result")
    arrivals = [a for a in ("closed", "poisson") if any(r["arrival"] == a for r in points)]
    fig, axes = plt.subplots(1, len(arrivals), figsize=(6.0 * len(arrivals), 4.4), squeeze=False)
    for ax, arrival in zip(axes[0], arrivals):
        mine = [r for r in points if r["arrival"] == arrival]
        for acceptance in dict.fromkeys(r["acceptance"] for r in mine):
            line = sorted(
                (r for r in mine if r["acceptance"] == acceptance), key=lambda r: r["level"]
            )
            ax.plot(
                [r["level"] for r in line],
                [r["goodput_over_best"] for r in line],
                marker="o",
                label=f"acceptance {acceptance:g}",
            )
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        levels = sorted({r["level"] for r in mine})
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [f"{x:g}" if arrival == "closed" else f"{x:.3g}" for x in levels])
        ax.minorticks_off()
        ax.set_xlabel(
            "concurrency (closed loop)" if arrival == "closed" else "request rate (Poisson, req/s)"
        )
        ax.set_ylabel(
            "goodput ÷ max(off, best fixed K)"
            if arrival == "closed"
            else "best's ÷ goodput's mean e2e latency"
        )
        ax.grid(True, alpha=0.3)
        ax.legend()
    return _save(fig, out_path, title)


def _save(fig, out_path: str | Path, title: str | None) -> Path:
    """Title, lay out, write the image (its folder made), close the figure; returns the
    path written. The format is the path's suffix (matplotlib's: .png, .svg, .pdf, ...);
    a path without one gets .png, as matplotlib would add it, so the path said is the one
    written."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_path = Path(out_path)
    if not out_path.suffix:
        out_path = out_path.with_name(out_path.name + ".png")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
