"""The server under abuse: authentication before any body byte is read, a body-size limit,
stalled connections dropped, strict request types, clear errors for wrong media types and
broken text, admission that counts prompts, SSE that line-splitting clients parse, keys
from a file or the environment, and a dead engine that ends the server."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
import socket
import subprocess
import time

import httpx
import pytest

from specserve.server.messages import OutputDelta
from tests.server.conftest import ServerProcess, read_all

KEY = "hardening-key"


@pytest.fixture(scope="module")
def guarded(tiny_llama, tmp_path_factory):
    """Key from a file, short read timeout, small body limit, a small queue."""
    folder = tmp_path_factory.mktemp("hardening")
    key_file = folder / "key"
    key_file.write_text(KEY + "\n")
    srv = ServerProcess(
        tiny_llama,
        folder,
        "--api-key-file",
        str(key_file),
        "--request-read-timeout",
        "1",
        "--max-request-bytes",
        "65536",
        "--max-num-seqs",
        "4",
        "--max-queue",
        "64",
        "--num-kv-pages",
        "16",
        "--served-model-name",
        "tinyllama",
    )
    srv.api_key = KEY  # (for the helpers: headers, metrics)
    yield srv
    srv.stop()


def _raw(server, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(data)
    return sock


def test_no_key_no_body_read(guarded):
    """A 100 MB body without the key gets its 401 after the headers, before the body is
    sent (here: never sent), and /health stays fast meanwhile. (No byte of the body goes
    out: bytes the server never reads make its close a reset, which may reach the client
    before the 401 does.)"""
    sock = _raw(
        guarded,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n",
    )
    started = time.monotonic()
    reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    assert b"invalid_api_key" in reply
    assert time.monotonic() - started < 5  # answered without waiting for 100 MB
    assert httpx.get(guarded.url + "/health", timeout=5).status_code == 200
    sock.close()


def test_body_limit_and_media_type(guarded):
    h = {"Authorization": f"Bearer {KEY}"}
    big = {"model": "tinyllama", "prompt": "x" * 70_000, "max_tokens": 1}
    r = httpx.post(guarded.url + "/v1/completions", json=big, headers=h, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: refused while reading
        for _ in range(20):
            yield b" " * 8192

    r = httpx.post(guarded.url + "/v1/completions", content=chunks(), headers=h, timeout=30)
    assert r.status_code == 413
    r = httpx.post(
        guarded.url + "/v1/completions", data={"prompt": "hi"}, headers=h, timeout=30
    )  # a form, as curl -d sends
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    r = httpx.post(  # a compressed body (it was read as JSON: "not valid JSON", a 400)
        guarded.url + "/v1/completions",
        content=gzip.compress(b'{"prompt": "hi"}'),
        headers={**h, "Content-Type": "application/json", "Content-Encoding": "gzip"},
        timeout=30,
    )
    assert r.status_code == 415 and "Content-Encoding 'gzip'" in r.json()["error"]["message"]


def test_stalled_connections_are_closed(guarded):
    # headers that never finish: the connection is closed after the read timeout
    sock = _raw(guarded, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    started = time.monotonic()
    assert read_all(sock) == b""
    assert 0.5 < time.monotonic() - started < 8
    sock.close()
    # a body that never finishes: 408
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    sock = _raw(guarded, head.encode() + b'{"pro')
    reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    sock.close()
    # an idle kept-alive connection after a response is closed too
    sock = _raw(guarded, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_all(sock).startswith(b"HTTP/1.1 200")
    sock.close()


@pytest.mark.parametrize(
    "change, param",
    [
        ({"max_tokens": "4"}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"temperature": "0.5"}, "temperature"),
        ({"prompt": [True, 5]}, "prompt"),
        ({"n": 1.0}, "n"),
    ],
)
def test_types_are_not_coerced(guarded, change, param):
    body = {"model": "tinyllama", "prompt": "hello", "max_tokens": 2, **change}
    r = httpx.post(guarded.url + "/v1/completions", json=body, headers=guarded.headers, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param), err
    assert "valid" in err["message"]  # "Input should be a valid integer" and the like


def test_broken_text_is_named_without_internals(guarded):
    body = {
        "model": "tinyllama",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi \ud800 there"}],
    }
    r = httpx.post(
        guarded.url + "/v1/chat/completions",
        headers=guarded.headers,
        timeout=30,
        content=json.dumps(body).encode(),  # ensure_ascii: a \\ud800 escape
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content"
    assert "unpaired surrogate (U+D800)" in err["message"]
    assert "codec" not in err["message"] and "Traceback" not in err["message"]


def test_admission_counts_prompts(guarded):
    """1,024 prompts on an idle server with 4 running slots and a queue of 64 can never fit:
    400 naming n; 60 can (4 run, 56 wait)."""
    body = {"model": "tinyllama", "prompt": [[5, 6, 7]] * 1024, "max_tokens": 1}
    r = httpx.post(guarded.url + "/v1/completions", json=body, headers=guarded.headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_choices", r.text
    body["prompt"] = [[5, 6, 7]] * 60
    r = httpx.post(guarded.url + "/v1/completions", json=body, headers=guarded.headers, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 60


def test_a_kv_cache_smaller_than_the_context_is_the_limit_said(guarded):
    """16 pages hold less than the model's 512-token context: /v1/models says what a request
    can hold, and a chat prompt past it is a 400 naming messages (not prompt)."""
    r = httpx.get(guarded.url + "/v1/models", headers=guarded.headers, timeout=10)
    limit = r.json()["data"][0]["max_model_len"]
    assert 0 < limit < 512
    words = " ".join(["fox"] * limit)
    body = {"model": "tinyllama", "messages": [{"role": "user", "content": words}]}
    r = httpx.post(
        guarded.url + "/v1/chat/completions", json=body, headers=guarded.headers, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert str(limit) in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded"  # (OpenAI's: clients trim)
    body["max_tokens"] = 600  # past the model's context (512) with a short prompt
    body["messages"][0]["content"] = "fox"
    r = httpx.post(
        guarded.url + "/v1/chat/completions", json=body, headers=guarded.headers, timeout=60
    )
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded", r.text
    assert error["message"].startswith("This model's maximum context length is 512 tokens")
    del body["max_tokens"]
    body["messages"][0]["content"] = "fox"
    r = httpx.post(
        guarded.url + "/v1/chat/completions", json=body, headers=guarded.headers, timeout=60
    )
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] <= limit


def test_the_key_guards_metrics_and_docs(guarded, tiny_llama, tmp_path, monkeypatch):
    for path in ("/metrics", "/openapi.json", "/docs", "/v1/models"):
        assert httpx.get(guarded.url + path, timeout=10).status_code == 401, path
        r = httpx.get(guarded.url + path, headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert r.status_code == 401, path
        assert (
            httpx.get(guarded.url + path, headers=guarded.headers, timeout=10).status_code == 200
        ), path
    # the scheme in any case (RFC 7235)
    r = httpx.get(
        guarded.url + "/v1/models", headers={"Authorization": f"bearer {KEY}"}, timeout=10
    )
    assert r.status_code == 200
    # the key from the environment (the server process inherits it); /metrics opened
    monkeypatch.setenv("SPECSERVE_API_KEY", "from-env")
    with ServerProcess(tiny_llama, tmp_path, "--public-metrics") as srv:
        assert httpx.get(srv.url + "/metrics", timeout=10).status_code == 200
        assert httpx.get(srv.url + "/v1/models", timeout=10).status_code == 401
        ok = httpx.get(
            srv.url + "/v1/models", headers={"Authorization": "Bearer from-env"}, timeout=10
        )
        assert ok.status_code == 200


def test_sse_survives_line_splitting_clients():
    """Text with U+2028, U+2029 and U+0085 streams as events that str.splitlines (httpx's
    aiter_lines) does not cut: one data line each, the text intact."""
    from specserve.server.app import _events
    from specserve.server.openai_format import CompletionFormatter
    from specserve.server.request_stream import END, RequestStream

    text = "a\u2028b\u2029c\u0085d"
    fmt = CompletionFormatter("cmpl-1", "m", 1, 3, None, None)  # (no logprobs: no TokenText)

    async def run() -> str:
        stream = RequestStream(["r-0"])
        stream._put((0, OutputDelta("r-0", text, [7], None, False, None)))
        stream._put((0, OutputDelta("r-0", "", [8], None, True, "length")))
        stream._put(END)
        return b"".join([chunk async for chunk in _events(stream, fmt, False)]).decode()

    lines = asyncio.run(run()).splitlines()
    data = [line[6:] for line in lines if line]
    assert all(line.startswith("data: ") for line in lines if line), lines
    assert data[-1] == "[DONE]"
    assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == text


def test_a_dead_engine_ends_the_server(tiny_llama, tmp_path):
    """kill -9 of the engine process: the stream in flight ends with an error event, the
    server logs how the engine ended and exits 3 (for a process manager to restart it)."""
    srv = ServerProcess(tiny_llama, tmp_path, "--served-model-name", "tinyllama")
    try:
        children = subprocess.run(
            ["pgrep", "-P", str(srv.proc.pid)], capture_output=True, text=True
        ).stdout.split()
        engines = [
            int(pid)
            for pid in children
            if "specserve" in _cmdline(pid) or "multiprocessing" in _cmdline(pid)
        ]
        assert engines, children
        body = {"prompt": "The quick", "max_tokens": 400, "stream": True, "ignore_eos": True}
        lines = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if len(lines) == 3:
                        for pid in engines:
                            os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        assert srv.proc.wait(30) == 3
        assert time.monotonic() - started < 30
        assert lines[-1] == "[DONE]"
        err = json.loads(lines[-2])["error"]
        assert err["code"] == "engine_unavailable" and "SIGKILL" in err["message"], err
        assert "killed by SIGKILL" in srv.log()
    finally:
        srv.stop()


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
