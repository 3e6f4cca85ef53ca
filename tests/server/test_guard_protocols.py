"""The header deadline (`guarded_http`) on both of uvicorn's HTTP protocols, httptools' and
h11's, each under a real uvicorn server in a thread: a connection whose headers never finish
is closed, one that sends them gets its response, and a kept-alive connection that goes
quiet after a response is closed too. (test_hardening.py runs the server as `specserve
serve` does, on whichever protocol is installed.)"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from specserve.server.guard import guarded_http, http_protocol_base
from tests.server.conftest import read_all

TIMEOUT_S = 0.5


async def _app(scope, receive, send):
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


def _protocols():
    from uvicorn.protocols.http.h11_impl import H11Protocol

    bases = [pytest.param(H11Protocol, id="h11")]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # (a dependency: installed wherever specserve is)
        bases.append(pytest.param(None, id="httptools", marks=pytest.mark.skip("no httptools")))
    else:
        bases.append(pytest.param(HttpToolsProtocol, id="httptools"))
    return bases


@pytest.fixture(params=_protocols())
def server(request):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    http = guarded_http(TIMEOUT_S, request.param)
    # uvicorn's own idle timeout far beyond the guard's: what closes an idle connection here
    # is the guard
    config = uvicorn.Config(
        _app, log_level="warning", http=http, lifespan="off", timeout_keep_alive=60
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    yield sock.getsockname()[1]
    srv.should_exit = True
    thread.join(10)


def test_headers_deadline(server):
    # headers that never finish: closed after the deadline, nothing sent
    sock = socket.create_connection(("127.0.0.1", server), timeout=10)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
    started = time.monotonic()
    assert read_all(sock) == b""
    assert TIMEOUT_S * 0.8 < time.monotonic() - started < 8
    sock.close()
    # complete headers: a response; the connection, kept alive, then closes when idle
    sock = socket.create_connection(("127.0.0.1", server), timeout=10)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    started = time.monotonic()
    reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"\r\n\r\nok")
    assert time.monotonic() - started < 30  # the guard's deadline, not uvicorn's 60 s
    sock.close()


def test_httptools_is_the_default_where_installed():
    try:
        import httptools  # noqa: F401
    except ImportError:
        assert http_protocol_base().__name__ == "H11Protocol"
    else:
        assert http_protocol_base().__name__ == "HttpToolsProtocol"
    assert guarded_http(1.0).__name__ == f"Guarded{http_protocol_base().__name__}"
