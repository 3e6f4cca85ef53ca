"""Backpressure (429 beyond the wait queue, every accepted request completes) and graceful
shutdown on SIGTERM (in-flight requests finish or are aborted, exit code 0); speculation
flags reach the engine and its metrics reach /metrics."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from tests.server.conftest import ServerProcess

MAX_TOKENS = 300


@pytest.fixture(scope="module")
def small_server(tiny_llama, tmp_path_factory):
    srv = ServerProcess(
        tiny_llama,
        tmp_path_factory.mktemp("small"),
        "--max-num-seqs",
        "2",
        "--max-queue",
        "2",
        "--served-model-name",
        "tinyllama",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def spec_server(tiny_llama, tmp_path_factory):
    """Speculating (the model drafts for itself, so every greedy draft is accepted); SIGTERM
    aborts at once."""
    srv = ServerProcess(
        tiny_llama,
        tmp_path_factory.mktemp("spec"),
        "--speculative-algorithm",
        "draft",
        "--speculative-draft-model-path",
        str(tiny_llama),
        "--speculative-policy",
        "fixed",
        "--shutdown-timeout",
        "0",
        "--served-model-name",
        "tinyllama",
    )
    yield srv
    srv.stop()


def test_burst_beyond_queue_gets_429(small_server):
    client = openai.AsyncOpenAI(base_url=small_server.url + "/v1", api_key="x", max_retries=0)

    async def one():
        try:
            out = await client.completions.create(
                model="tinyllama",
                prompt="The quick",
                max_tokens=MAX_TOKENS,
                extra_body={"ignore_eos": True},
            )
            return out
        except openai.RateLimitError as e:
            return e

    async def burst():
        return await asyncio.gather(*[one() for _ in range(12)])

    results = asyncio.run(burst())
    rejected = [r for r in results if isinstance(r, openai.RateLimitError)]
    accepted = [r for r in results if not isinstance(r, Exception)]
    assert len(rejected) + len(accepted) == 12
    assert rejected and len(accepted) >= 4  # 2 running + 2 waiting fit
    for e in rejected:
        assert e.response.headers["retry-after"] == "1"
        assert e.body["code"] == "queue_full" and e.body["type"] == "rate_limit_error"
    for out in accepted:
        assert out.usage.completion_tokens == MAX_TOKENS
        assert out.choices[0].finish_reason == "length"
    assert small_server.wait_metric("specserve_kv_pages_used", 0.0) == 0.0
    m = small_server.metrics()
    assert m['specserve_requests_total{endpoint="/v1/completions",status="429"}'] == len(rejected)


def test_speculation_through_the_server(small_server, spec_server):
    """Greedy output with speculation equals plain decoding, and /metrics shows it."""
    outs = []
    for srv in (small_server, spec_server):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        kw = dict(
            model="tinyllama",
            prompt="The quick brown",
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        whole = client.completions.create(**kw).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
        assert streamed == whole
        outs.append(whole)
    assert outs[0] == outs[1]
    m = spec_server.metrics()
    assert m["specserve_spec_draft_tokens_total"] > 0
    assert m["specserve_spec_accepted_tokens_total"] == m["specserve_spec_draft_tokens_total"]
    assert m['specserve_engine_spec_policy_info{spec_policy="FixedPolicy"}'] == 1
    assert m["specserve_engine_spec_simulated_acceptance"] == 0
    assert (
        sum(
            v
            for k, v in m.items()
            if k.startswith("specserve_spec_draft_length_steps_total{draft_len=")
        )
        > 0
    )
    assert not any(k.startswith("specserve_spec_") for k in small_server.metrics())


def _stream_in_thread(server, max_tokens: int, first_event: threading.Event, out: list):
    body = {
        "prompt": "The quick",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    lines = []
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    first_event.set()
    except httpx.HTTPError as e:
        lines.append(f"error: {e!r}")
    finally:
        first_event.set()
        out.append(lines)


def test_sigterm_finishes_in_flight_then_exits_0(small_server):
    first, out = threading.Event(), []
    t = threading.Thread(target=_stream_in_thread, args=(small_server, MAX_TOKENS, first, out))
    t.start()
    assert first.wait(60)
    assert small_server.terminate(timeout_s=90) == 0
    t.join(60)
    lines = out[0]
    assert lines[-1] == "[DONE]", lines[-3:]
    assert json.loads(lines[-2])["usage"]["completion_tokens"] == MAX_TOKENS
    with pytest.raises(httpx.ConnectError):
        httpx.get(small_server.url + "/health", timeout=5)
    assert "Traceback" not in small_server.log()


def test_sigterm_past_the_timeout_aborts_and_exits_0(spec_server):
    first, out = threading.Event(), []
    t = threading.Thread(target=_stream_in_thread, args=(spec_server, 480, first, out))
    t.start()
    assert first.wait(60)
    assert spec_server.terminate(timeout_s=60) == 0
    t.join(60)
    lines = out[0]
    assert lines[-1] == "[DONE]"  # ended cleanly, with an error event instead of usage
    assert json.loads(lines[-2])["error"]["code"] == "shutting_down"
    assert len(lines) < 480
    assert "Traceback" not in spec_server.log()
