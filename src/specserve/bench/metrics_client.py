"""Reads a server's Prometheus /metrics before and after a run and turns the difference into
the report's server-side figures: requests by status, prompt and generated tokens, and, when
the server exports them, speculation figures (acceptance rate and length, draft-length mix).

specserve's names come from server/metrics.py; vLLM's equivalents are read too, so the
bench says the same things about either server. A server without /metrics gives no figures.
"""

from __future__ import annotations

import re

import httpx

Sample = tuple[str, tuple[tuple[str, str], ...]]  # (name, sorted label pairs)

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_API_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# (specserve name, vLLM name) of each counter the report uses.
_COUNTERS = {
    "prompt_tokens": ("specserve_prompt_tokens_total", "vllm:prompt_tokens_total"),
    "generation_tokens": ("specserve_generation_tokens_total", "vllm:generation_tokens_total"),
    "draft_tokens": (
        "specserve_spec_draft_tokens_total",
        "vllm:spec_decode_num_draft_tokens_total",
    ),
    "accepted_tokens": (
        "specserve_spec_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
    ),
    "verify_steps": ("specserve_spec_verify_steps_total", "vllm:spec_decode_num_drafts_total"),
    "preemptions": ("specserve_preemptions_total", "vllm:num_preemptions_total"),
    # (a counter since session 41; a gauge of that name before)
    "engine_steps": ("specserve_engine_steps_total", "specserve_engine_steps"),
}


def parse_metrics(text: str) -> dict[Sample, float]:
    """Prometheus text format to {(name, labels): value}; comments and junk lines skipped."""
    out: dict[Sample, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = value
    return out


def scrape(
    base_url: str, timeout_s: float = 10.0, api_key: str | None = None
) -> dict[Sample, float] | None:
    """The server's metrics now, or None when it has no /metrics (or refuses the key)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        resp = httpx.get(base_url + "/metrics", headers=headers, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return parse_metrics(resp.text)


def _total(samples: dict[Sample, float], name: str, **match: str) -> float | None:
    """Sum of a metric over label sets that match; None when the server has no such metric."""
    if not name:
        return None
    found = [
        v
        for (n, labels), v in samples.items()
        if n == name and all(dict(labels).get(k) == val for k, val in match.items())
    ]
    return sum(found) if found else None


def _delta(before: dict, after: dict, name: str, **match: str) -> float | None:
    a = _total(after, name, **match)
    if a is None:
        return None
    return a - (_total(before, name, **match) or 0.0)


def _counter(before: dict, after: dict, key: str) -> float | None:
    for name in _COUNTERS[key]:
        d = _delta(before, after, name)
        if d is not None:
            return d
    return None


def api_requests_by_status(before: dict, after: dict) -> dict[str, int]:
    """API requests to the completion endpoints during the run, by HTTP status."""
    statuses = sorted(
        {dict(labels).get("status", "") for (n, labels) in after if n == "specserve_requests_total"}
    )
    out = {}
    for status in statuses:
        n = sum(
            _delta(before, after, "specserve_requests_total", endpoint=e, status=status) or 0
            for e in _API_ENDPOINTS
        )
        if n:
            out[status] = int(n)
    return out


def _by_label(
    before: dict, after: dict, name: str, label: str, exact: bool = True
) -> dict[str, int | float]:
    """Run deltas of a labelled counter, by label value (numeric order), zeros dropped;
    whole numbers unless `exact` is False."""
    keys = sorted(
        {dict(labels).get(label, "") for (n, labels) in after if n == name},
        key=lambda k: int(k) if k.isdigit() else 0,
    )
    counts = {k: _delta(before, after, name, **{label: k}) or 0 for k in keys}
    return {k: int(v) if exact else v for k, v in counts.items() if v}


def _ms(before: dict, after: dict, stem: str) -> float | None:
    """Run delta of a counter of seconds, `stem` + "_seconds_total", in ms (a server before
    session 42 counted milliseconds: `stem` + "_ms_total")."""
    seconds = _delta(before, after, stem + "_seconds_total")
    if seconds is not None:
        return 1000.0 * seconds
    return _delta(before, after, stem + "_ms_total")


def _ms_by_label(before: dict, after: dict, stem: str, label: str) -> dict[str, float]:
    """`_by_label` of a labelled counter of seconds, in ms (as `_ms`)."""
    seconds = _by_label(before, after, stem + "_seconds_total", label, exact=False)
    if seconds:
        return {k: 1000.0 * v for k, v in seconds.items()}
    return _by_label(before, after, stem + "_ms_total", label, exact=False)


def _draft_len_mix(before: dict, after: dict) -> dict[str, int]:
    return _by_label(before, after, "specserve_spec_draft_length_steps_total", "draft_len")


def server_figures(before: dict | None, after: dict | None) -> dict | None:
    """What the server counted during the run; None when it exports no metrics."""
    if before is None or after is None:
        return None
    out: dict = {"requests_by_status": api_requests_by_status(before, after)}
    for key in ("prompt_tokens", "generation_tokens", "preemptions", "engine_steps"):
        value = _counter(before, after, key)
        if value is not None:
            out[key] = int(value)
    out.update(step_figures(before, after))
    out.update(ttft_figures(before, after))
    spec = speculation_figures(before, after)
    if spec:
        out["speculation"] = spec
    return out


def step_figures(before: dict, after: dict) -> dict:
    """How the engine's steps went during the run: mean step time and idle gap between
    steps (ms, from specserve's histograms); per step on average, the device's busy and
    idle time and the host's wait for drawn tokens (ms, GPU servers: a device busy for
    most of the step bounds it, else the host does); and the steps launched only after the
    previous step's tokens reached the host (overlap lost), in all and by reason; steps by
    kind (decode-only or carrying prefill, and K) and each kind's mean time (ms: device
    spans on a GPU server)."""
    out: dict = {}
    count = _delta(before, after, "specserve_engine_step_duration_seconds_count")
    for key, name in (
        ("step_ms_mean", "specserve_engine_step_duration_seconds"),
        ("step_gap_ms_mean", "specserve_engine_step_gap_seconds"),
    ):
        total, n = _delta(before, after, name + "_sum"), _delta(before, after, name + "_count")
        if total is not None and n:
            out[key] = 1000.0 * total / n
    for key, stem in (
        ("device_busy_ms_mean", "specserve_engine_device_step"),
        ("device_idle_ms_mean", "specserve_engine_device_gap"),
        ("host_wait_ms_mean", "specserve_engine_host_wait"),
    ):
        total = _ms(before, after, stem)
        if total and count:
            out[key] = total / count
    host = _ms_by_label(before, after, "specserve_engine_host", "part")
    if host and count:  # host time a step by part (ms), waits for drawn tokens apart
        out["host_ms_by_part_mean"] = {part: ms / count for part, ms in host.items()}
    kinds = _by_label(before, after, "specserve_engine_step_kind_steps_total", "kind")
    if kinds:  # steps by kind (decode or carrying prefill, and K), and each kind's mean
        kind_ms = _ms_by_label(before, after, "specserve_engine_step_kind", "kind")
        out["steps_by_kind"] = dict(sorted(kinds.items()))
        out["step_ms_by_kind_mean"] = {k: kind_ms.get(k, 0.0) / n for k, n in kinds.items()}
    waits = _delta(before, after, "specserve_engine_loop_waits_total")
    if waits is None:  # (a server before session 41: a gauge)
        waits = _delta(before, after, "specserve_engine_loop_waits")
    if waits is not None:
        out["loop_waits"] = int(waits)
        reasons = _by_label(before, after, "specserve_engine_loop_waits_by_reason_total", "reason")
        if reasons:
            out["loop_wait_reasons"] = reasons
    return out


def ttft_figures(before: dict, after: dict) -> dict:
    """The server's own mean time to first token (ms, from a request's submission to the
    server handling its first tokens) and its parts, which add up to it: to_engine,
    in_engine and back; and the server's time around it (streamed requests): intake, from
    the request reaching the app to its submission, and first_chunk, from its first tokens
    handled to their event written (server/metrics.py)."""

    def mean_ms(name: str, **match: str) -> float | None:
        total = _delta(before, after, name + "_sum", **match)
        count = _delta(before, after, name + "_count", **match)
        return 1000.0 * total / count if total is not None and count else None

    out: dict = {}
    ttft = mean_ms("specserve_time_to_first_token_seconds")
    if ttft is not None:
        out["ttft_ms_mean"] = ttft
    parts = {
        part: mean_ms("specserve_time_to_first_token_parts_seconds", part=part)
        for part in ("to_engine", "in_engine", "back")
    }
    if all(v is not None for v in parts.values()):
        out["ttft_parts_ms_mean"] = parts
    outside = {
        part: mean_ms("specserve_time_to_first_token_outside_seconds", part=part)
        for part in ("intake", "first_chunk")
    }
    if all(v is not None for v in outside.values()):
        out["ttft_outside_ms_mean"] = outside
    return out


def speculation_figures(before: dict, after: dict) -> dict:
    """Drafted and accepted tokens, acceptance rate, mean acceptance length (tokens committed
    per verify step, bonus included) and the draft-length mix, as far as the server says."""
    drafted = _counter(before, after, "draft_tokens")
    accepted = _counter(before, after, "accepted_tokens")
    mix = _draft_len_mix(before, after)
    out: dict = {}
    if drafted is not None:
        out["draft_tokens"] = int(drafted)
    if accepted is not None:
        out["accepted_tokens"] = int(accepted)
    if drafted and accepted is not None:
        out["acceptance_rate"] = accepted / drafted
    verify_steps = _counter(before, after, "verify_steps")
    if verify_steps is None and mix:
        verify_steps = sum(v for k, v in mix.items() if k != "0")
    if verify_steps and accepted is not None:
        out["verify_steps"] = int(verify_steps)
        out["mean_acceptance_length"] = (accepted + verify_steps) / verify_steps
    if mix:
        total = sum(mix.values())
        out["draft_length_mix"] = {k: v / total for k, v in mix.items()}
    hist = _by_label(before, after, "specserve_spec_accepted_per_step_total", "accepted")
    if hist:
        out["accepted_per_step"] = hist
    drafted_at = _by_label(before, after, "specserve_spec_position_drafted_total", "position")
    accepted_at = _by_label(before, after, "specserve_spec_position_accepted_total", "position")
    if drafted_at:
        out["acceptance_by_position"] = {
            k: accepted_at.get(k, 0) / n for k, n in drafted_at.items()
        }
    for (name, labels), value in after.items():
        if name == "specserve_engine_spec_policy_info" and value:
            out["policy"] = dict(labels).get("spec_policy")
    periods = _ms_by_label(before, after, "specserve_spec_step_period", "k")
    timed = _by_label(before, after, "specserve_spec_timed_steps_total", "k")
    if timed:  # the mean period of a step at each K, under this policy
        out["step_ms_by_k"] = {k: periods.get(k, 0.0) / n for k, n in timed.items()}
        device = _ms_by_label(before, after, "specserve_spec_step_device", "k")
        if any(device.values()):  # and its device span (CUDA): host-bound where far below
            out["device_ms_by_k"] = {k: device.get(k, 0.0) / n for k, n in timed.items()}
    parts = _by_label(before, after, "specserve_spec_plain_timed_steps_total", "part")
    if parts:  # plain steps with the drafter dormant, or with prefill: their mean period
        ms = _ms_by_label(before, after, "specserve_spec_plain_step_period", "part")
        out["plain_step_ms_by_part"] = {k: ms.get(k, 0.0) / n for k, n in parts.items()}
        dev = _ms_by_label(before, after, "specserve_spec_plain_step_device", "part")
        if any(dev.values()):
            out["plain_device_ms_by_part"] = {k: dev.get(k, 0.0) / n for k, n in parts.items()}
    wakes = _by_label(before, after, "specserve_spec_drafter_wakes_total", "cause")
    if wakes:  # what woke a dormant drafter, by cause
        out["drafter_wakes"] = wakes
    for key in (
        "dormant_steps",
        "settled_steps",
        "drafting_held",
        "plain_overruled",
        "drafter_eager_passes",
        "drafter_eager_tokens",
    ):
        value = _delta(before, after, f"specserve_spec_{key}_total")
        if value:
            out[key] = int(value)
    if _total(after, "specserve_engine_spec_simulated_acceptance"):
        out["simulated_acceptance"] = True  # outputs were not the model's: say so
    # Numeric speculation stats the engine exports as gauges (goodput...), as of the run's end.
    gauges = {
        name.removeprefix("specserve_engine_"): v
        for (name, labels), v in after.items()
        if name.startswith("specserve_engine_spec_") and not labels
    }
    if gauges:
        out["engine_gauges"] = gauges
    # The goodput policy's tables at the run's end: {table: {bucket: {K|direction|mode: v}}},
    # and its figures without a bucket (the prefill surcharge and price), ms for seconds
    tables: dict = {}
    scalars: dict = {}
    for (name, labels), v in after.items():
        if not name.startswith("specserve_spec_policy_"):
            continue
        name = name.removeprefix("specserve_spec_policy_")
        if name.endswith("_seconds"):  # (the report's figures are in ms)
            name, v = name.removesuffix("_seconds") + "_ms", 1000.0 * v
        if not labels:
            scalars[name] = v
        else:
            cell = dict(labels)
            bucket = cell.pop("bucket", "")
            key = next(iter(cell.values()), "")
            table = tables.setdefault(name, {})
            table.setdefault(bucket, {})[key] = v
    if scalars:
        out["policy_scalars"] = scalars
    if tables:
        out["policy_tables"] = {
            table: dict(sorted(rows.items(), key=lambda kv: int(kv[0] or 0)))
            for table, rows in tables.items()
        }
    return out
