"""Measure the engine's idle gap between model steps under many concurrent streams.

Starts `specserve serve` on a free loopback port, opens `--streams` streaming completions at
once (each `--max-tokens` tokens, ignore_eos), reads them to the end, and reports the step
gap and step duration histograms of /metrics (the difference over the run):

    python -m specserve.server.bench_step_gap --streams 256 --max-tokens 64 [--model PATH]
        [--pin-engine-cpu 0]

Extra arguments after `--` go to `specserve serve` unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx

_SAMPLE = re.compile(
    r"^(specserve_engine_step_(?:gap|duration)_seconds)_(bucket|sum|count)"
    r'(?:\{le="([^"]+)"\})? ([0-9.e+-]+)$',
    re.M,
)


def _scrape(url: str) -> dict:
    """{metric: {"sum": s, "count": c, "buckets": [(le, cumulative count), ...]}}."""
    out: dict = {}
    for name, kind, le, value in _SAMPLE.findall(httpx.get(url + "/metrics").text):
        m = out.setdefault(name, {"sum": 0.0, "count": 0.0, "buckets": []})
        if kind == "bucket":
            m["buckets"].append((float(le), float(value)))
        else:
            m[kind] = float(value)
    return out


def _summary(before: dict, after: dict) -> dict:
    count = after["count"] - before["count"]
    total = after["sum"] - before["sum"]
    buckets = [(le, a - b) for (le, a), (_, b) in zip(after["buckets"], before["buckets"])]

    def quantile(q: float) -> float:
        """Upper bound of the bucket holding the q-quantile."""
        for le, cum in buckets:
            if cum >= q * count:
                return le
        return float("inf")

    mean = total / count if count else float("nan")
    return {
        "count": int(count),
        "mean_ms": 1e3 * mean,
        "p50_ms": 1e3 * quantile(0.5),
        "p90_ms": 1e3 * quantile(0.9),
        "p99_ms": 1e3 * quantile(0.99),
    }


async def _one(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> int:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    events = 0
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            events += line.startswith("data: ")
    return events


async def _load(url: str, streams: int, max_tokens: int) -> float:
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(
            *[
                _one(http, url, f"Request {i}: write a story about caches.", max_tokens)
                for i in range(streams)
            ]
        )
        return time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pin(server_pid: int, engine_cpu: int) -> None:
    """Give the engine process one CPU of its own; the HTTP process and this load generator
    share the others (Linux only)."""
    children = []
    for task in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    others = set(os.sched_getaffinity(0)) - {engine_cpu}
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"multiprocessing" in f.read():
                os.sched_setaffinity(pid, {engine_cpu})
    os.sched_setaffinity(server_pid, others)
    os.sched_setaffinity(0, others)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--pin-engine-cpu",
        type=int,
        default=None,
        help="run the engine process alone on this CPU (Linux)",
    )
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "specserve.cli",
        "serve",
        "--port",
        str(port),
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
        *extra,
    ]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        while True:
            if proc.poll() is not None:
                return 1
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        if args.pin_engine_cpu is not None:
            _pin(proc.pid, args.pin_engine_cpu)
        asyncio.run(_load(url, 8, 4))  # warm-up
        before = _scrape(url)
        wall_s = asyncio.run(_load(url, args.streams, args.max_tokens))
        after = _scrape(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    tokens = args.streams * args.max_tokens
    print(
        f"{args.streams} streams x {args.max_tokens} tokens in {wall_s:.1f} s "
        f"({tokens / wall_s:.0f} tok/s)"
    )
    for name, label in (
        ("specserve_engine_step_gap_seconds", "step gap"),
        ("specserve_engine_step_duration_seconds", "step duration"),
    ):
        s = _summary(before[name], after[name])
        print(
            f"{label}: n={s['count']} mean={s['mean_ms']:.3f} ms  p50<={s['p50_ms']:.3f} ms"
            f"  p90<={s['p90_ms']:.3f} ms  p99<={s['p99_ms']:.3f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
