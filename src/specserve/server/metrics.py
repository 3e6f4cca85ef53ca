"""Prometheus metrics of one server, kept in their own registry (no process globals).

Latencies are measured in the HTTP process from the arrival of the API request; step
durations and the idle gaps between back-to-back model steps are measured in the engine
process and shipped with each step report. Engine gauges (running, waiting, KV pages,
preemptions) are read from the engine's latest stats at scrape time.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)
_ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0,
)
_GAP_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
    0.25, 1.0,
)
# Engine stats exported under fixed names; any other numeric stat the engine adds later is
# exported as a gauge `specserve_engine_<key>`.
_ENGINE_GAUGES = {
    "running": ("specserve_num_requests_running", "requests running in the engine"),
    "waiting": ("specserve_num_requests_waiting", "requests waiting in the engine's queue"),
    "kv_pages_used": ("specserve_kv_pages_used", "KV cache pages held by requests"),
    "kv_pages_total": ("specserve_kv_pages_total", "KV cache pages that can be lent"),
}
_ENGINE_COUNTERS = {
    "preemptions": ("specserve_preemptions", "requests preempted for lack of KV pages"),
}


class ServerMetrics:
    """Every metric /metrics reports. `engine_stats` is a callable returning the engine's
    latest stats dict (wired by the app once the engine client exists)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "specserve_requests", "API requests by endpoint and HTTP status",
            ["endpoint", "status"], registry=r,
        )
        self.finished = Counter(
            "specserve_request_finished", "engine requests (choices) finished, by reason",
            ["finish_reason"], registry=r,
        )
        self.prompt_tokens = Counter(
            "specserve_prompt_tokens", "prompt tokens of accepted requests", registry=r
        )
        self.generation_tokens = Counter(
            "specserve_generation_tokens", "tokens generated", registry=r
        )
        self.ttft = Histogram(
            "specserve_time_to_first_token_seconds", "arrival to first generated token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "specserve_inter_token_latency_seconds", "time between tokens of a request",
            buckets=_ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "specserve_e2e_request_latency_seconds", "arrival to last token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.step_duration = Histogram(
            "specserve_engine_step_duration_seconds", "one model step in the engine process",
            buckets=_GAP_BUCKETS, registry=r,
        )
        self.step_gap = Histogram(
            "specserve_engine_step_gap_seconds",
            "engine idle time between back-to-back model steps (IPC, scheduling overhead)",
            buckets=_GAP_BUCKETS, registry=r,
        )
        self.engine_stats: Callable[[], dict] = dict
        self.in_flight: Callable[[], int] = lambda: 0
        r.register(_EngineCollector(self))
        self.spec: SpecMetrics | None = None

    def observe_steps(self, step_s: list[float], gap_s: list[float]) -> None:
        for s in step_s:
            self.step_duration.observe(s)
        for g in gap_s:
            self.step_gap.observe(g)

    def observe_spec_stats(self, spec_stats) -> None:
        """Hook for speculation statistics carried by RequestOutput.spec_stats; the metrics
        are registered on first use, so a server that never speculates reports none."""
        if self.spec is None:
            self.spec = SpecMetrics(self.registry)
        self.spec.observe(spec_stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SpecMetrics:
    """Speculation metrics: drafted and accepted tokens, and how often each draft length
    was chosen. `observe` reads `draft_len` and `accept_len` (per request, this step) from
    the engine's spec_stats object or dict; adapt it when that shape settles."""

    def __init__(self, registry: CollectorRegistry):
        self.draft_tokens = Counter(
            "specserve_spec_draft_tokens", "draft tokens proposed", registry=registry
        )
        self.accepted_tokens = Counter(
            "specserve_spec_accepted_tokens", "draft tokens accepted", registry=registry
        )
        self.draft_len_steps = Counter(
            "specserve_spec_draft_length_steps", "request-steps by chosen draft length",
            ["draft_len"], registry=registry,
        )

    def observe(self, spec_stats) -> None:
        def get(name):
            if isinstance(spec_stats, dict):
                return spec_stats.get(name)
            return getattr(spec_stats, name, None)

        draft_len, accept_len = get("draft_len"), get("accept_len")
        if draft_len is not None:
            self.draft_tokens.inc(draft_len)
            self.draft_len_steps.labels(str(draft_len)).inc()
        if accept_len is not None:
            self.accepted_tokens.inc(accept_len)


class _EngineCollector:
    """Reads the engine's latest stats at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        stats = self.metrics.engine_stats()
        yield GaugeMetricFamily(
            "specserve_num_requests_in_flight",
            "engine requests accepted by the HTTP server and not finished",
            value=self.metrics.in_flight(),
        )
        for key, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key in _ENGINE_COUNTERS:
                name, doc = _ENGINE_COUNTERS[key]
                yield CounterMetricFamily(name, doc, value=value)
            else:
                safe = re.sub(r"[^a-zA-Z0-9_]", "_", key)
                name, doc = _ENGINE_GAUGES.get(key, (f"specserve_engine_{safe}", f"engine {key}"))
                yield GaugeMetricFamily(name, doc, value=value)
