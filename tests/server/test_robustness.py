"""The server against parties that get stuck: a client that never reads its stream (the
output waiting for it is bounded, and it counts toward admission while it waits), an engine
process stopped without dying (noticed: requests fail, /health says why; it serves again
once resumed), and a SIGTERM while the engine still loads (both processes end)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from specserve.bench.server_process import free_port
from tests.server.conftest import read_all

ABORTED = 'specserve_request_finished_total{finish_reason="abort"}'
LENGTH = 'specserve_request_finished_total{finish_reason="length"}'
IN_FLIGHT = "specserve_num_requests_in_flight"


def _unread_stream(server, body: dict) -> socket.socket:
    """A streamed completion whose client reads nothing (a small receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", server.port))
    data = json.dumps({"model": "tinyllama", "stream": True, "ignore_eos": True, **body}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def _events(reply: bytes) -> list[bytes]:
    """The data of each server-sent event of a raw chunked reply (an event per chunk)."""
    return [line[6:] for line in reply.split(b"\n") if line.startswith(b"data: ")]


def _wait_growth(server, names: list[str], before: dict, timeout_s: float = 120.0) -> dict:
    """/metrics once one of `names` has grown past `before`."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if any(m.get(n, 0.0) > before.get(n, 0.0) for n in names):
            return m
        assert time.monotonic() < deadline, f"none of {names} grew"
        time.sleep(0.1)


def test_an_unread_stream_is_stopped_at_its_bound(server):
    """64 choices with 20 logprobs a token (~80 MB held, unread) pass the stream's bound
    (16 MiB) long before they finish: all are aborted, the backlog dropped and the stream
    released; a client that reads again gets the error, then [DONE]."""
    before = server.metrics()
    sock = _unread_stream(
        server, {"prompt": "The quick", "n": 64, "logprobs": 20, "max_tokens": 480}
    )
    try:
        after = _wait_growth(server, [ABORTED, LENGTH], before)
        assert after.get(ABORTED, 0) - before.get(ABORTED, 0) == 64
        assert after.get(LENGTH, 0) == before.get(LENGTH, 0)
        assert after['specserve_streams_stopped_total{reason="backlog"}'] >= 1
        assert server.wait_metric(IN_FLIGHT, 0.0) == 0.0
        reply = read_all(sock)
    finally:
        sock.close()
    assert reply.startswith(b"HTTP/1.1 200")
    events = _events(reply)
    assert events[-1] == b"[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "slow_reader" and "too slowly" in err["message"], err


def test_a_stream_counts_until_delivered(server):
    """A stream the engine has finished but its client has not read (9 MB of events, more
    than the sockets hold) still counts toward admission; once read it no longer does."""
    before = server.metrics()
    sock = _unread_stream(server, {"prompt": "The quick", "n": 64, "max_tokens": 480})
    try:
        after = _wait_growth(server, [LENGTH], {LENGTH: before.get(LENGTH, 0) + 63})
        assert after.get(ABORTED, 0) == before.get(ABORTED, 0)
        assert after[IN_FLIGHT] == 64  # (before: 0 once the engine finished them)
        reply = read_all(sock)
    finally:
        sock.close()
    events = _events(reply)
    assert events[-1] == b"[DONE]" and not any(e.startswith(b'{"error"') for e in events)
    assert server.wait_metric(IN_FLIGHT, 0.0) == 0.0


def test_a_stopped_engine_is_noticed_and_serves_again(server):
    """SIGSTOP of the engine process (wedged, not dead): within its silence bound (15 s) the
    stream in flight ends with an error event, /health answers 503 saying why and new
    requests get 503; once resumed it serves again."""
    engine = _engine_pid(server)
    body = {
        "model": "tinyllama",
        "prompt": "The quick",
        "max_tokens": 480,
        "stream": True,
        "ignore_eos": True,
    }
    lines: list[str] = []
    try:
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=40
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if len(lines) == 2:
                        os.kill(engine, signal.SIGSTOP)
        assert lines[-1] == "[DONE]"
        err = json.loads(lines[-2])["error"]
        assert err["code"] == "engine_unresponsive" and "not answered" in err["message"], err
        r = httpx.get(server.url + "/health", timeout=10)
        assert r.status_code == 503 and "stopped or hung" in r.json()["error"]["message"]
        body["stream"] = False
        r = httpx.post(
            server.url + "/v1/completions", json=body, headers=server.headers, timeout=30
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unresponsive"
    finally:
        os.kill(engine, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "/health did not recover"
        time.sleep(0.2)
    body["max_tokens"] = 4
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert "Traceback" not in server.log()


def test_sigterm_while_starting_stops_the_engine(tiny_llama, tmp_path):
    """SIGTERM as soon as the engine process exists (it loads the model; it ignores
    SIGTERM itself): the server exits 143 and the engine process goes with it."""
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", "serve", "--port", str(free_port())]
        + ["--model", str(tiny_llama)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 60
        while (engine := _spawned_children(proc.pid)) == []:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 143
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in engine):
            assert time.monotonic() < deadline, "the engine process outlived the server"
            time.sleep(0.1)
        assert "stopped by SIGTERM while starting" in (tmp_path / "server.log").read_text()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # (its own session: only what it started)
        except ProcessLookupError:
            pass
        log.close()


def _spawned_children(pid: int) -> list[int]:
    """`pid`'s children started by multiprocessing's spawn, oldest first."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    found = []
    for child in map(int, out.split()):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{child}/stat") as f:
                started = int(f.read().rsplit(")", 1)[1].split()[19])
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            found.append((started, child))
    return [child for _, child in sorted(found)]


def _engine_pid(server) -> int:
    """The engine process: the server's first spawned child (grammar workers come later)."""
    children = _spawned_children(server.proc.pid)
    assert children, "no engine process found"
    return children[0]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
