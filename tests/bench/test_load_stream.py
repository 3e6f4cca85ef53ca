"""The load generator's streaming (bench/load.py, through aiohttp) against stub servers on a
loopback port: the request it writes, bodies cut anywhere, and how a response can fail."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from specserve.bench.datasets import BenchPrompt
from specserve.bench.load import LoadConfig, client_session, send_request


async def _with_server(handler, body):
    """Run `body(url)` against a server answering each connection with `handler`."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        request = head + await reader.readexactly(length)
        try:
            await handler(request, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        return await body(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _chunked(body: bytes, sizes: list[int]) -> bytes:
    out, at = b"", 0
    for size in sizes:
        piece = body[at : at + size]
        if piece:
            out += b"%x\r\n" % len(piece) + piece + b"\r\n"
        at += size
    return out + b"0\r\n\r\n"


async def _send(cfg: LoadConfig, prompt: BenchPrompt):
    async with client_session(cfg) as client:
        return await send_request(client, cfg, prompt, 0.0)


def test_the_request_on_the_wire():
    """A POST of the JSON body to the endpoint under the base URL's path, with the API key,
    on a connection closed after it."""
    seen = []

    async def handler(request, writer):
        seen.append(request)
        body = b"data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))
        await writer.drain()

    async def body(url):
        return await _send(LoadConfig(url + "/api/", api_key="k"), BenchPrompt("p", 4))

    r = asyncio.run(_with_server(handler, body))
    assert r.ok, r.error  # (no text: nothing to time, but a whole answer)
    head, _, payload = seen[0].partition(b"\r\n\r\n")
    lines = head.decode().lower().split("\r\n")
    assert lines[0] == "post /api/v1/completions http/1.1"
    assert {"authorization: bearer k", "content-type: application/json"} <= set(lines)
    assert "connection: close" in lines
    assert json.loads(payload)["prompt"] == "p" and json.loads(payload)["stream"] is True
    with pytest.raises(ValueError, match="base URL"):
        LoadConfig("ftp://h")


@pytest.mark.parametrize("seed", range(3))
def test_events_cut_anywhere_arrive_whole(seed):
    """A streamed answer written in random pieces (cutting events, line ends and UTF-8
    characters), each piece its own chunk and write: the same text and usage as written."""
    rng = random.Random(seed)
    words = ["héllo", " 世界", " 🙂", " a\\nb", " plain"]
    texts = [rng.choice(words) for _ in range(40)]
    events = b"".join(_sse({"choices": [{"index": 0, "text": t}]}) for t in texts)
    usage = {"prompt_tokens": 3, "completion_tokens": 40}
    events += _sse({"choices": [], "usage": usage}).replace(b"\n\n", b"\r\n\r\n")
    events += b"data: [DONE]\n\n"
    sizes = [rng.randint(1, 9) for _ in range(len(events))]
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    head += b"transfer-encoding: chunked\r\n\r\n"

    async def handler(request, writer):
        wire = head + _chunked(events, sizes)
        at = 0
        while at < len(wire):
            step = rng.randint(1, 40)
            writer.write(wire[at : at + step])
            await writer.drain()
            await asyncio.sleep(0)
            at += step

    async def body(url):
        return await _send(LoadConfig(url, api_key="k"), BenchPrompt("p", 40))

    r = asyncio.run(_with_server(handler, body))
    assert r.ok, r.error_message
    assert r.output_text == "".join(texts) and r.output_tokens == 40 and r.prompt_tokens == 3
    assert len(r.itl_s) == 39


def test_a_server_that_stops_sending_times_out():
    async def handler(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(_chunked(_sse({"choices": [{"index": 0, "text": "a"}]}), [99])[:-5])
        await writer.drain()
        await asyncio.sleep(5)

    async def body(url):
        return await _send(LoadConfig(url, timeout_s=0.2), BenchPrompt("p", 4))

    r = asyncio.run(_with_server(handler, body))
    assert r.error == "timeout" and r.ttft_s is not None


def test_a_connection_closed_mid_answer():
    async def handler(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"20\r\ndata: {")  # a chunk cut short, then the connection ends

    async def body(url):
        return await _send(LoadConfig(url), BenchPrompt("p", 4))

    r = asyncio.run(_with_server(handler, body))
    assert r.error == "connection closed"


def test_responses_without_chunks_and_errors():
    """A whole body by its length, an error status with its page, garbage instead of HTTP."""
    replies = iter(
        [
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy",
            b"SPAM\r\n\r\n",
        ]
    )

    async def handler(request, writer):
        writer.write(next(replies))
        await writer.drain()

    async def body(url):
        cfg = LoadConfig(url)
        return [await _send(cfg, BenchPrompt("p", 4)) for _ in range(2)]

    busy, garbage = asyncio.run(_with_server(handler, body))
    assert busy.error == "HTTP 503" and busy.error_message == "busy"
    assert garbage.error == "connection closed" and not garbage.ok


def test_events_of_other_shapes_and_an_end_without_done():
    """A stream ending after a finish_reason without [DONE] is complete (vLLM's bench takes
    it so); one ending before any is not; an event that is not a JSON object fails that
    request, not the run; a choice or usage of another shape is skipped."""
    chunk = {"choices": [{"index": 0, "text": "ab", "finish_reason": None}]}
    last = {"choices": [{"index": 0, "text": "c", "finish_reason": "length"}], "usage": None}
    streams = iter(
        [
            _sse(chunk) + _sse({"choices": [5], "usage": [1]}) + _sse(last),
            _sse(chunk),
            _sse(chunk) + b"data: [1, 2]\n\n" + b"data: [DONE]\n\n",
        ]
    )

    async def handler(request, writer):
        body = next(streams)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()

    async def body(url):
        cfg = LoadConfig(url)
        return [await _send(cfg, BenchPrompt("p", 4)) for _ in range(3)]

    ended, cut, odd = asyncio.run(_with_server(handler, body))
    assert ended.ok and ended.output_text == "abc" and ended.output_tokens == 2  # (chunks)
    assert not cut.ok and cut.error == "stream ended before [DONE]"
    assert not odd.ok and odd.error == "stream event not an object"
    assert odd.error_message == "[1, 2]"


def test_poisson_arrivals_keep_the_seeds_schedule_on_a_busy_loop(monkeypatch):
    """Each arrival is placed by the clock from the start: a loop that wakes late (here every
    sleep overshoots by 10 ms) does not push every later arrival back, which lowered the
    offered rate by the loop's business (-27% at 300 req/s on a busy 2-core client)."""
    import math

    from specserve.bench import load
    from specserve.bench.report import summarize

    clock, real_sleep = [0.0], asyncio.sleep
    monkeypatch.setattr(load.time, "perf_counter", lambda: clock[0])  # (patched while it runs)

    async def late_sleep(seconds):
        await real_sleep(0)  # (the request created last starts, at its arrival)
        clock[0] += seconds + (0.010 if seconds else 0.0)

    async def fake_send(client, cfg, p, run_start):
        return load.RequestResult(ok=True, start_s=clock[0] - run_start)

    monkeypatch.setattr(load.asyncio, "sleep", late_sleep)
    monkeypatch.setattr(load, "send_request", fake_send)
    cfg = LoadConfig("http://h", request_rate=20.0, seed=3)
    results, _ = asyncio.run(load._run(None, cfg, [BenchPrompt("p", 4)] * 200, 200, None))
    rng = random.Random(3)
    scheduled = [0.0]
    for _ in range(199):
        scheduled.append(scheduled[-1] + rng.expovariate(20.0))
    starts = [r.start_s for r in results]
    assert all(math.isclose(s, want, abs_tol=0.0101) for s, want in zip(starts, scheduled))
    assert summarize(results, max(starts))["arrival_rate"] == pytest.approx(199 / starts[-1])
