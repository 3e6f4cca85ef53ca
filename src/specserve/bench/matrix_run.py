"""Runs the adaptive-speculation matrix: one server at a time, each serving every load point of
its configuration before the next starts (a server start costs about a minute on a GPU).

Every configuration sees the same prompts and the same arrival times at a point (a dataset is
built once a point, in the order the points run, and the load's seed is fixed); no point
sends another's prompts (datasets.build_dataset's `part`, a JSONL file's RecordCursor).
Each row is the runner's report (with the server's /metrics figures: draft-length mix,
acceptance) plus a `matrix` entry naming its configuration, acceptance and point.
"""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from specserve.bench.datasets import WARMUP_PART, Dataset
from specserve.bench.load import LoadConfig
from specserve.bench.matrix import (
    MatrixSpec,
    Point,
    ServerRun,
    closed_points,
    poisson_points,
    requests_for,
)
from specserve.bench.server_process import ServerProcess, ServerStartError
from specserve.bench.sweep import measure, warm_up


@dataclass
class MatrixPlan:
    """The matrix plus what every server and every run shares."""

    spec: MatrixSpec
    runs: list[ServerRun]
    num_prompts: int
    server_args: list[str]
    load: LoadConfig  # the template: base_url, max_concurrency and request_rate set per point
    warmup_requests: int = 2
    server_env: dict[str, str] | None = None
    log_dir: Path | None = None


def point_load(load: LoadConfig, url: str, point: Point) -> LoadConfig:
    """The load of one point: a concurrency limit (closed) or Poisson arrivals (open)."""
    if point.arrival == "closed":
        return replace(
            load, base_url=url, max_concurrency=int(point.level), request_rate=float("inf")
        )
    return replace(load, base_url=url, max_concurrency=None, request_rate=point.level)


def off_peak_request_rate(rows: list[dict]) -> float | None:
    """The highest request throughput the off server reached in the closed loop."""
    rates = [
        r["request_throughput"]
        for r in rows
        if r["matrix"]["config"] == "off" and r["matrix"]["arrival"] == "closed"
    ]
    return max(rates, default=None)


@dataclass
class MatrixResult:
    """The rows of every run, the Poisson points as resolved, and the servers that never
    became healthy (name and the end of their log): their points are missing, the rest ran."""

    rows: list[dict] = field(default_factory=list)
    poisson: list[Point] = field(default_factory=list)
    failed_servers: list[dict] = field(default_factory=list)


def run_matrix(
    plan: MatrixPlan,
    make_dataset: Callable[[int, int], Dataset],
    progress: bool = True,
    on_server_done: Callable[[MatrixResult], None] | None = None,
) -> MatrixResult:
    """Every server at every point. `on_server_done` gets the result so far each time a
    server has served all its points or failed to start (a matrix runs for an hour on a
    GPU: one server that cannot start, e.g. out of memory at a large K, costs only its own
    points)."""
    log_dir = plan.log_dir or Path(tempfile.mkdtemp(prefix="specserve-matrix-"))
    datasets: dict[tuple, Dataset] = {}

    def dataset(point: Point) -> Dataset:  # each point its own prompts, every server's alike
        key = (point.arrival, point.level)
        if key not in datasets:
            n = requests_for(plan.spec, point, plan.num_prompts)
            datasets[key] = make_dataset(n, 1 + len(datasets))  # (in the order points run)
        return datasets[key]

    result = MatrixResult()
    rows = result.rows
    closed = closed_points(plan.spec)
    poisson: list[Point] | None = None
    if not plan.spec.relative_rates:
        poisson = poisson_points(plan.spec, None)
    for run in plan.runs:
        flags = plan.server_args + run.flags
        print(
            f"[matrix] starting server '{run.name}': specserve serve {shlex.join(flags)}",
            flush=True,
        )
        try:
            started = ServerProcess(flags, log_dir / f"{run.name}.log", env=plan.server_env)
        except ServerStartError as e:
            error = str(e)
            last = next((ln for ln in reversed(error.splitlines()) if ln.strip()), error)
            print(
                f"[matrix] server '{run.name}' did not start, its points are left out: "
                f"{last.strip()[:300]}",
                flush=True,
            )
            result.failed_servers.append({"server": run.name, "error": error[-3000:]})
            if on_server_done is not None:
                on_server_done(result)
            continue
        with started as server:
            warm_up(
                plan.load, server, make_dataset(1, WARMUP_PART).prompts[0], plan.warmup_requests
            )
            for point in closed:
                rows.append(_measure_point(plan.load, server, run, point, dataset(point), progress))
            if poisson is None:  # relative rates: off's closed loop has just run
                peak = off_peak_request_rate(rows)
                if not peak:
                    print(
                        "[matrix] off completed no closed-loop request (or did not run): "
                        "the Poisson points relative to its peak are left out",
                        flush=True,
                    )
                poisson = poisson_points(plan.spec, peak)
            for point in poisson:
                rows.append(_measure_point(plan.load, server, run, point, dataset(point), progress))
        result.poisson = poisson
        if on_server_done is not None:
            on_server_done(result)
    return result


def _measure_point(
    load: LoadConfig,
    server: ServerProcess,
    run: ServerRun,
    point: Point,
    dataset: Dataset,
    progress: bool,
) -> dict:
    report = measure(
        point_load(load, server.url, point),
        dataset,
        run.config,
        run.flags,
        progress,
        f"{run.name} {point.label}",
        server,
    )
    report["matrix"] = {
        "config": run.config,
        "policy": run.policy,
        "k": run.k,
        "acceptance": run.acceptance,
        "arrival": point.arrival,
        "level": point.level,
        "rate_fraction": point.fraction,
        "server": run.name,
    }
    return report
