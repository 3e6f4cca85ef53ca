"""Clients that go away abort their engine requests at once: their KV pages are freed
(checked through /metrics), and the metrics the server exports are all there."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

NUM_STREAMS = 200
LONG = 400  # tokens a dropped request would need to finish (context is 512)


def _finished(server, reason: str) -> float:
    return server.metrics().get(
        f'specserve_request_finished_total{{finish_reason="{reason}"}}', 0.0
    )


# Every stream's prompt begins the same (several pages): they share cached pages.
SHARED = "Paged attention stores keys and values in fixed size pages. " * 3


async def _open_and_drop(
    server, started: asyncio.Event, reached: list, all_in: asyncio.Event, i: int
):
    body = {
        "model": "tinyllama",
        "prompt": SHARED + f"The quick brown fox {i}",
        "max_tokens": LONG,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    limits = httpx.Limits(max_connections=1)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        async with http.stream(
            "POST", server.url + "/v1/completions", json=body, headers=server.headers
        ) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()  # held, not broken out of: that would close the stream
            events = 0
            while events < 2:
                line = await lines.__anext__()
                if line.startswith("data: "):
                    assert line != "data: [DONE]"
                    json.loads(line[6:])
                    events += 1
            reached.append(1)
            if len(reached) == NUM_STREAMS:
                all_in.set()
            await all_in.wait()
            await started.wait()
        # leaving the block closes the connection mid-stream


def test_dropped_streams_free_their_pages(server):
    """Streams sharing a prompt prefix (their requests hold its cached pages together) are
    dropped mid-stream: every page is released, the shared ones stay cached, idle."""
    aborted_before = _finished(server, "abort")
    length_before = _finished(server, "length")
    hits_before = server.metrics().get("specserve_prefix_cache_hit_tokens_total", 0.0)

    async def run():
        started, all_in, reached = asyncio.Event(), asyncio.Event(), []
        tasks = [
            asyncio.create_task(_open_and_drop(server, started, reached, all_in, i))
            for i in range(NUM_STREAMS)
        ]
        await asyncio.wait_for(all_in.wait(), 120)
        during = await asyncio.to_thread(server.metrics)
        started.set()
        await asyncio.gather(*tasks)
        return during

    during = asyncio.run(run())
    assert during["specserve_kv_pages_used"] > 0
    assert (
        during["specserve_num_requests_running"] + during["specserve_num_requests_waiting"]
        == NUM_STREAMS
    )
    assert server.wait_metric("specserve_kv_pages_used", 0.0) == 0.0
    after = server.metrics()
    assert after["specserve_num_requests_running"] == 0
    assert after["specserve_num_requests_in_flight"] == 0
    assert _finished(server, "length") == length_before  # none ran to the end
    assert _finished(server, "abort") - aborted_before == NUM_STREAMS
    assert after["specserve_prefix_cache_hit_tokens_total"] - hits_before >= 32 * NUM_STREAMS // 2
    assert after["specserve_prefix_cache_idle_pages"] == after["specserve_prefix_cache_pages"] > 0


def test_dropped_whole_response_is_aborted(server):
    """A client that stops waiting for a whole (non-streamed) response aborts all its
    choices. It disconnects once the server reports them running: no timing assumption
    about how long they take (a read timeout once let a fast machine finish them first)."""
    aborted_before = _finished(server, "abort")
    body = {
        "model": "tinyllama",
        "prompt": "The quick",
        "max_tokens": 500,  # (context 512): far more steps than the disconnect takes
        "n": 8,
        "ignore_eos": True,
    }

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            post = asyncio.create_task(
                client.post(server.url + "/v1/completions", json=body, headers=server.headers)
            )
            while (await asyncio.to_thread(server.metrics))["specserve_num_requests_running"] < 8:
                assert not post.done(), "the response ended before all its choices ran"
                await asyncio.sleep(0.01)
            post.cancel()  # closes the connection
            with pytest.raises(asyncio.CancelledError):
                await post

    asyncio.run(run())
    assert server.wait_metric("specserve_kv_pages_used", 0.0) == 0.0
    assert _finished(server, "abort") - aborted_before == 8


def test_metrics_exported(server, client):
    before = server.metrics()
    out = client.completions.create(model="tinyllama", prompt="a b c", max_tokens=4, n=3)
    steps_before = before.get("specserve_engine_steps_total", 0)
    deadline = time.monotonic() + 30  # (the engine's figures come with its next report)
    while (after := server.metrics()).get("specserve_engine_steps_total", 0) <= steps_before:
        assert time.monotonic() < deadline, "the engine's step counter did not grow"
        time.sleep(0.05)
    # prompt tokens as the usage counts them: the prompt once, whatever n
    grown = after["specserve_prompt_tokens_total"] - before.get("specserve_prompt_tokens_total", 0)
    assert grown == out.usage.prompt_tokens
    assert "specserve_engine_loop_waits_total" in after  # (counters, as Prometheus types them)
    text = httpx.get(server.url + "/metrics", headers=server.headers).text
    for name in [
        'specserve_requests_total{endpoint="/v1/completions",status="200"}',
        "specserve_prompt_tokens_total",
        "specserve_generation_tokens_total",
        "specserve_time_to_first_token_seconds_bucket",
        "specserve_inter_token_latency_seconds_bucket",
        "specserve_e2e_request_latency_seconds_bucket",
        "specserve_engine_step_gap_seconds_bucket",
        "specserve_engine_step_duration_seconds_bucket",
        "specserve_num_requests_running",
        "specserve_num_requests_waiting",
        "specserve_kv_pages_used",
        "specserve_kv_pages_total",
        "specserve_preemptions_total",
    ]:
        assert name in text, name
    assert "specserve_spec_" not in text  # no speculation, no speculation metrics
    m = server.metrics()
    assert m["specserve_engine_step_gap_seconds_count"] > 0
    assert m["specserve_kv_pages_total"] > 0
