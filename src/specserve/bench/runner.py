"""One benchmark run end to end: find the model, build the prompts, read /metrics, send the
load with a progress bar, read /metrics again and summarize."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

import httpx

from specserve.bench.datasets import Dataset
from specserve.bench.load import LoadConfig, RequestResult, run_load
from specserve.bench.metrics_client import api_requests_by_status, scrape, server_figures
from specserve.bench.report import summarize
from specserve.core.errors import SpecserveError


class BenchError(SpecserveError):
    """The benchmark cannot start (server unreachable, no model); the message says why."""


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url + "/v1/models", headers=headers, timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
        raise BenchError(  # (TypeError: a body of another shape, e.g. a JSON list)
            f"cannot list models at {base_url}/v1/models ({e}); is the server "
            "running? pass --model to skip this"
        ) from e


def _answered(results: list[RequestResult]) -> int:
    """Requests the server gave an HTTP answer to (what its request counter counts)."""
    return sum(1 for r in results if r.ok or (r.error or "").startswith(("HTTP", "stream error")))


def _settled_scrape(
    base_url: str, before: dict | None, answered: int, api_key: str | None, wait_s: float = 5.0
):
    """/metrics after the run. The server counts a request once its response has ended,
    which can be a moment after the client saw the last byte: wait for the counts to arrive."""
    deadline = time.monotonic() + wait_s
    while True:
        after = scrape(base_url, api_key=api_key)
        if after is None or before is None:
            return after
        counts_requests = any(name == "specserve_requests_total" for name, _ in after)
        counted = sum(api_requests_by_status(before, after).values())
        if not counts_requests or counted >= answered or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


def benchmark(
    cfg: LoadConfig, dataset: Dataset, progress: bool = True, desc: str = "requests"
) -> dict:
    """Run the load and return the report (a JSON-ready dict)."""
    before = scrape(cfg.base_url, api_key=cfg.api_key)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=dataset.num_requests, desc=desc, unit="req", leave=False)
    try:
        results, duration_s = asyncio.run(
            run_load(cfg, dataset.prompts, on_done=(lambda _: bar.update(1)) if bar else None)
        )
    finally:
        if bar is not None:
            bar.close()
    after = _settled_scrape(cfg.base_url, before, _answered(results), cfg.api_key)
    config = asdict(cfg)
    config.pop("api_key", None)
    if cfg.request_rate == float("inf"):
        config["request_rate"] = "inf"  # JSON has no infinity
    report = summarize(
        results,
        duration_s,
        server_figures(before, after),
        config=config,
        dataset={
            "name": dataset.name,
            "num_prompts": len(dataset.prompts),  # conversations, for multi-turn
            "shared_prefix_len": dataset.shared_prefix_len,
            "notes": dataset.notes,
        },
    )
    return report
