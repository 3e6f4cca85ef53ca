"""Prometheus metrics of one server, kept in their own registry (no process globals).

Latencies are measured in the HTTP process, from the moment a request is handed to the
engine (after validation and tokenization) to the arrival of its tokens there. Step
durations and the idle gaps between back-to-back model steps are measured in the engine
process and shipped with each step report. Engine gauges (running, waiting, KV pages,
preemptions, speculation) are read from the engine's latest stats at scrape time.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_ITL_BUCKETS = (  # (speculation's tokens a step apart: well under a millisecond each)
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
_GAP_BUCKETS = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    1.0,
)
_STEP_BUCKETS = (*_GAP_BUCKETS, 2.5, 5.0, 10.0, 30.0)
# Engine stats exported under fixed names; any other number the engine reports is exported
# as a gauge `specserve_engine_<key>` (a string as `..._info{<key>="value"}`, lists below).
_ENGINE_GAUGES = {
    "spec_policy_prefill_surcharge_ms": (
        "specserve_spec_policy_prefill_surcharge_seconds",
        "goodput policy: what drafting adds to a step carrying prefill beyond its cost model "
        "(seconds), measured, and priced into such steps' choice of K",
    ),
    "spec_policy_prefill_upkeep_ms": (
        "specserve_spec_policy_prefill_upkeep_seconds",
        "goodput policy: what keeping the drafter up costs a step carrying prefill (host time "
        "of its passes the host had no time to spare for, seconds), measured, and charged to "
        "drafting against the drafter dormant",
    ),
    "spec_policy_prefill_price_tokens_per_s": (
        "specserve_spec_policy_prefill_price_tokens_per_second",
        "goodput policy: what a second of a step carrying prefill is worth in tokens (the "
        "running rate by decoding rows, never below the server's average), against which "
        "drafts there are ranked",
    ),
    "running": ("specserve_num_requests_running", "requests running in the engine"),
    "waiting": ("specserve_num_requests_waiting", "requests waiting in the engine's queue"),
    "kv_pages_used": ("specserve_kv_pages_used", "KV cache pages held by requests"),
    "kv_pages_total": ("specserve_kv_pages_total", "KV cache pages that can be lent"),
    "prefix_cache_pages": (
        "specserve_prefix_cache_pages",
        "KV pages in the prefix cache (held by requests or idle)",
    ),
    "prefix_cache_idle_pages": (
        "specserve_prefix_cache_idle_pages",
        "cached KV pages no request holds: evictable, counted as free",
    ),
}
_ENGINE_COUNTERS = {
    "steps": ("specserve_engine_steps", "engine steps run"),
    "loop_waits": (
        "specserve_engine_loop_waits",
        "steps launched only once the step in flight's tokens were read (by reason: "
        "specserve_engine_loop_waits_by_reason_total)",
    ),
    "spec_probe_steps": ("specserve_engine_spec_probe_steps", "steps the policy drafted to probe"),
    "spec_switches": (
        "specserve_engine_spec_switches",
        "steps crossing between plain decoding and drafting",
    ),
    "spec_k_changes": ("specserve_engine_spec_k_changes", "steps whose draft length changed"),
    "preemptions": ("specserve_preemptions", "requests preempted for lack of KV pages"),
    "prefix_cache_queried_tokens": (
        "specserve_prefix_cache_queried_tokens",
        "prompt tokens of admitted requests looked up in the prefix cache",
    ),
    "prefix_cache_hit_tokens": (
        "specserve_prefix_cache_hit_tokens",
        "prompt tokens found in the prefix cache (hit rate: this / queried tokens)",
    ),
    "prefix_cache_evictions": (
        "specserve_prefix_cache_evictions",
        "cached KV pages evicted to make room",
    ),
    "device_step_ms": (
        "specserve_engine_device_step_seconds",
        "device time of engine steps, first kernel to last (GPU only), seconds",
    ),
    "device_gap_ms": (
        "specserve_engine_device_gap_seconds",
        "device idle time between back-to-back engine steps (GPU only), seconds",
    ),
    "host_wait_ms": (
        "specserve_engine_host_wait_seconds",
        "time the engine blocked waiting for steps' drawn tokens, seconds",
    ),
    "spec_dormant_steps": (
        "specserve_spec_dormant_steps",
        "steps taken while the drafter's upkeep was stopped (goodput policy, dormant)",
    ),
    "spec_settled_steps": (
        "specserve_spec_settled_steps",
        "steps whose draft length repeated a settled decision without deliberating (goodput)",
    ),
    "spec_drafting_held": (
        "specserve_spec_drafting_held",
        "decisions to draft overruled: drafting delivered less than plain decoding (goodput)",
    ),
    "spec_plain_overruled": (
        "specserve_spec_plain_overruled",
        "decisions for plain decoding overruled: drafting delivered more (goodput)",
    ),
    "spec_drafter_eager_passes": (
        "specserve_spec_drafter_eager_passes",
        "drafter passes run eagerly (no graph replay): catch-ups, ride-alongs, draft steps",
    ),
    "spec_drafter_eager_tokens": (
        "specserve_spec_drafter_eager_tokens",
        "tokens the drafter's eager passes took",
    ),
}


class ServerMetrics:
    """Every metric /metrics reports. `engine_stats` is a callable returning the engine's
    latest stats dict (wired by the app once the engine client exists)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "specserve_requests",
            "API requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.finished = Counter(
            "specserve_request_finished",
            "engine requests (choices) finished, by reason: stop, length, abort (the client "
            "left, the server shut down), error (the engine refused it)",
            ["finish_reason"],
            registry=r,
        )
        self.streams_stopped = Counter(
            "specserve_streams_stopped",
            "streams stopped because their client did not read them: backlog (too much output "
            "waited; their requests aborted), write_timeout (a write waited too long; the "
            "connection closed)",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "specserve_prompt_tokens",
            "prompt tokens of accepted requests (each prompt once, as usage counts them)",
            registry=r,
        )
        self.generation_tokens = Counter(
            "specserve_generation_tokens", "tokens generated", registry=r
        )
        self.ttft = Histogram(
            "specserve_time_to_first_token_seconds",
            "submission to first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_parts = Histogram(
            "specserve_time_to_first_token_parts_seconds",
            "time to first token in parts that add up to it: to_engine (submission to the "
            "engine process taking the request in, behind the step it was running), in_engine "
            "(scheduling, prefill and the first token's steps, to the report that carries it "
            "being sent), back (that report to the server and its handling)",
            ["part"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_outside = Histogram(
            "specserve_time_to_first_token_outside_seconds",
            "the server's share of a streamed request's time to first token outside "
            "time_to_first_token: intake (its arrival at the app, headers read, to its "
            "submission: body, validation, tokenization) and first_chunk (its first tokens "
            "handled to their event written to the connection)",
            ["part"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "specserve_inter_token_latency_seconds",
            "time between tokens of a request",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "specserve_e2e_request_latency_seconds",
            "submission to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.step_duration = Histogram(
            "specserve_engine_step_duration_seconds",
            "one model step in the engine process",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.step_gap = Histogram(
            "specserve_engine_step_gap_seconds",
            "engine idle time between back-to-back model steps (IPC, scheduling overhead)",
            buckets=_GAP_BUCKETS,
            registry=r,
        )
        self.engine_stats: Callable[[], dict] = dict
        self.in_flight: Callable[[], int] = lambda: 0
        self.engine_silent_s: Callable[[], float] = lambda: 0.0
        self.prompt_stats: Callable[[], dict] = dict  # PromptEncoder.stats
        r.register(_EngineCollector(self))
        r.register(_PromptCollector(self))
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
    """Per-request speculation totals, added when a request finishes: drafted and accepted
    tokens, verify steps, and how many verify steps accepted k drafts. Reads the fields of
    the engine's SpecStats (drafted, accepted, verify_steps, accept_hist)."""

    def __init__(self, registry: CollectorRegistry):
        self.draft_tokens = Counter(
            "specserve_spec_draft_tokens", "draft tokens proposed", registry=registry
        )
        self.accepted_tokens = Counter(
            "specserve_spec_accepted_tokens", "draft tokens accepted", registry=registry
        )
        self.verify_steps = Counter(
            "specserve_spec_verify_steps", "request-steps that verified drafts", registry=registry
        )
        self.accept_len = Counter(
            "specserve_spec_accepted_per_step",
            "verify request-steps by drafts accepted",
            ["accepted"],
            registry=registry,
        )

    def observe(self, spec_stats) -> None:
        self.draft_tokens.inc(getattr(spec_stats, "drafted", 0))
        self.accepted_tokens.inc(getattr(spec_stats, "accepted", 0))
        self.verify_steps.inc(getattr(spec_stats, "verify_steps", 0))
        for k, n in enumerate(getattr(spec_stats, "accept_hist", ()) or ()):
            if n:
                self.accept_len.labels(str(k)).inc(n)


# Engine stats that are lists, exported as labelled counters: key -> (name, label, doc).
_ENGINE_LISTS = {
    "spec_steps_by_draft_len": (
        "specserve_spec_draft_length_steps",
        "draft_len",
        "request-steps by the draft length the policy chose (0: plain decoding)",
    ),
    "spec_steps_by_step_k": (
        "specserve_spec_step_k_steps",
        "k",
        "steps by the one draft length chosen for the step",
    ),
    "spec_period_ms_by_step_k": (
        "specserve_spec_step_period_seconds",
        "k",
        "wall-clock periods of steps (seconds, summed) by the step's draft length",
    ),
    "spec_timed_steps_by_step_k": (
        "specserve_spec_timed_steps",
        "k",
        "steps whose period was measured, by the step's draft length",
    ),
    "spec_device_ms_by_step_k": (
        "specserve_spec_step_device_seconds",
        "k",
        "device spans of those steps (seconds, summed; CUDA only) by the step's draft length",
    ),
    "spec_position_drafted": (
        "specserve_spec_position_drafted",
        "position",
        "draft positions verified, by position: every position up to a request's first "
        "rejected draft (accepted / verified is the rate given the drafts before were right)",
    ),
    "spec_position_accepted": (
        "specserve_spec_position_accepted",
        "position",
        "draft tokens accepted, by position",
    ),
}


# Engine stats that are {label: count} dicts, exported as labelled counters.
_ENGINE_DICTS = {
    "loop_wait_reasons": (
        "specserve_engine_loop_waits_by_reason",
        "reason",
        "steps that waited for the previous step's tokens on the host, by reason (launched "
        "after them; *_before_sampling: launched first, sampled after them)",
    ),
    "host_ms_by_part": (
        "specserve_engine_host_seconds",
        "part",
        "host time of engine steps (seconds, summed; waits for drawn tokens excluded) by part: "
        "schedule, draft, prepare, forward (queueing it), sample (logit changes and grammar "
        "masks in), process",
    ),
    "steps_by_kind": (
        "specserve_engine_step_kind_steps",
        "kind",
        "engine steps processed, by kind: decode (every row decodes or verifies) or prefill (a "
        'prompt chunk rides along), and the step\'s K ("prefill K=1")',
    ),
    "step_ms_by_kind": (
        "specserve_engine_step_kind_seconds",
        "kind",
        "time of those steps (seconds, summed) by kind: device spans on CUDA, host time elsewhere",
    ),
    "spec_plain_ms_by_part": (
        "specserve_spec_plain_step_period_seconds",
        "part",
        "wall-clock periods of plain (K=0) steps (seconds, summed): "
        "dormant drafter, with prefill, or awake (decode-only, the drafter kept up)",
    ),
    "spec_plain_device_ms_by_part": (
        "specserve_spec_plain_step_device_seconds",
        "part",
        "device spans of those steps (seconds, summed; CUDA only): "
        "dormant drafter, with prefill, or awake (decode-only, the drafter kept up)",
    ),
    "spec_plain_steps_by_part": (
        "specserve_spec_plain_timed_steps",
        "part",
        "plain (K=0) steps whose period was measured: "
        "dormant drafter, with prefill, or awake (decode-only, the drafter kept up)",
    ),
    "spec_wakes": (
        "specserve_spec_drafter_wakes",
        "cause",
        "decisions that woke a dormant drafter (goodput): prefill, decode or favored",
    ),
}


# The goodput policy's tables (Speculator.stats: {"bucket:key": value}), exported as gauges
# labelled by batch bucket and the key: key -> (name, second label, doc).
_ENGINE_TABLES = {
    "spec_policy_period_ms": (
        "specserve_spec_policy_period_seconds",
        "k",
        "goodput policy: the steady period (seconds) of a step of `bucket` requests at K, as its "
        "cost model now estimates it (decode attention's context term left out)",
    ),
    "spec_policy_period_observations": (
        "specserve_spec_policy_period_observations",
        "k",
        "goodput policy: the steady periods its cost model took at the bucket and K",
    ),
    "spec_policy_switch_ms": (
        "specserve_spec_policy_switch_seconds",
        "direction",
        "goodput policy: what a switch of K costs beyond steady steps (seconds), by direction: "
        "up (from plain decoding), down (to it), lateral (between two K > 0)",
    ),
    "spec_policy_switch_observations": (
        "specserve_spec_policy_switch_observations",
        "direction",
        "goodput policy: the switches its cost model measured, by direction",
    ),
    "spec_policy_mode_factor": (
        "specserve_spec_policy_mode_factor",
        "mode",
        "goodput policy: what each mode (plain: the drafter dormant; drafting) delivered "
        "over what its decisions expected",
    ),
    "spec_policy_mode_steps": (
        "specserve_spec_policy_mode_steps",
        "mode",
        "goodput policy: the steps each mode's factor spans",
    ),
    "spec_policy_expected_tokens": (
        "specserve_spec_policy_expected_tokens",
        "k",
        "goodput policy: the tokens a request its last decode-only decision at the bucket "
        "expected a step at K to commit",
    ),
    "spec_policy_expected_period_ms": (
        "specserve_spec_policy_expected_period_seconds",
        "k",
        "goodput policy: the period (seconds) its last decode-only decision at the bucket "
        "ranked K by (decode attention at the requests' context included)",
    ),
}


# Engine stats kept in milliseconds, exported in seconds (Prometheus' base unit)
_IN_MS = frozenset(
    {
        "device_step_ms",
        "device_gap_ms",
        "host_wait_ms",
        "spec_period_ms_by_step_k",
        "spec_device_ms_by_step_k",
        "host_ms_by_part",
        "step_ms_by_kind",
        "spec_plain_ms_by_part",
        "spec_plain_device_ms_by_part",
        "spec_policy_period_ms",
        "spec_policy_expected_period_ms",
        "spec_policy_switch_ms",
        "spec_policy_prefill_surcharge_ms",
        "spec_policy_prefill_upkeep_ms",
    }
)


class _PromptCollector:
    """The HTTP process's tokenizing of long prompts that share a prefix with a recent one
    (server/prompt_prefixes.py), read at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        stats = self.metrics.prompt_stats()
        if not stats:
            return
        yield CounterMetricFamily(
            "specserve_prompt_prefix_reuses",
            "prompt texts tokenized from a cut: a recent prompt's tokens up to it, the rest "
            "encoded alone",
            value=stats["prompts_from_cut"],
        )
        yield CounterMetricFamily(
            "specserve_prompt_prefix_reused_tokens",
            "prompt tokens taken from a recent prompt's tokens instead of encoded",
            value=stats["tokens_reused"],
        )
        yield GaugeMetricFamily(
            "specserve_prompt_prefix_kept_prompts",
            "long prompt texts whose tokens the HTTP process keeps for reuse",
            value=stats["prompts_kept"],
        )


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
            "engine requests accepted by the HTTP server and not finished or not yet delivered",
            value=self.metrics.in_flight(),
        )
        yield GaugeMetricFamily(
            "specserve_engine_silent_seconds",
            "time since the engine process last reported (it does at least every second)",
            value=self.metrics.engine_silent_s(),
        )
        for key, value in stats.items():
            safe = re.sub(r"[^a-zA-Z0-9_]", "_", key)
            unit = 1e-3 if key in _IN_MS else 1  # (ms to seconds)
            if key in _ENGINE_LISTS and isinstance(value, (list, tuple)):
                name, label, doc = _ENGINE_LISTS[key]
                family = CounterMetricFamily(name, doc, labels=[label])
                for i, v in enumerate(value):
                    family.add_metric([str(i)], v * unit)
                yield family
            elif key in _ENGINE_TABLES and isinstance(value, dict):
                name, label, doc = _ENGINE_TABLES[key]
                family = GaugeMetricFamily(name, doc, labels=["bucket", label])
                for cell, v in sorted(value.items()):
                    family.add_metric(cell.split(":", 1), v * unit)
                yield family
            elif key in _ENGINE_DICTS and isinstance(value, dict):
                name, label, doc = _ENGINE_DICTS[key]
                family = CounterMetricFamily(name, doc, labels=[label])
                for k, v in sorted(value.items()):
                    family.add_metric([str(k)], v * unit)
                yield family
            elif isinstance(value, str):  # e.g. the policy's name
                family = GaugeMetricFamily(
                    f"specserve_engine_{safe}_info", f"engine {key}", labels=[key]
                )
                family.add_metric([value], 1)
                yield family
            elif isinstance(value, bool):  # e.g. simulated acceptance: say it loudly
                yield GaugeMetricFamily(
                    f"specserve_engine_{safe}", f"engine {key}", value=int(value)
                )
            elif not isinstance(value, (int, float)) or value != value:
                continue  # other shapes, and NaN
            elif key in _ENGINE_COUNTERS:
                name, doc = _ENGINE_COUNTERS[key]
                yield CounterMetricFamily(name, doc, value=value * unit)
            else:
                name, doc = _ENGINE_GAUGES.get(key, (f"specserve_engine_{safe}", f"engine {key}"))
                yield GaugeMetricFamily(name, doc, value=value * unit)
