"""The load generator's HTTP/1.1 client: a request sent on a connection of its own, its
response parsed by httptools (the C parser uvicorn uses) as it arrives, its body read as lines.

httpx, which the load generator used before, spent ~1.9 ms of the client's CPU on a
streamed request and ~0.17 ms on each event against the server (h11 and httpcore are pure
Python; 2-core CPU, a 2,112-token prompt): with 16 streams of an 8B model on an H200 (an
event every 6 ms each) that kept the client's one event loop about half busy, and a
closed-loop wave of 16 new requests spent ~30 ms of it in turn, all inside the TTFTs the
bench reports (issue 31). Against a stub server sending an event every 2 ms, httpx takes
~1.4 ms a request and ~0.15 ms an event, this client ~0.37 and ~0.065. What it leaves out,
a benchmark against a server does not need: proxies (it always connects directly),
redirects, cookies, compression, HTTP/2.

Like httpx's defaults, `timeout_s` bounds each wait for the server (connecting: at most
30 s), not the whole request.
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

import httptools

_CONNECT_TIMEOUT_S = 30.0


class ConnectFailed(OSError):
    """No connection to the server (refused, unreachable, name not found)."""


class ConnectionClosed(Exception):
    """The connection ended before the response did, or the response was not HTTP."""


class RequestTimeout(Exception):
    """The server sent nothing for `timeout_s`."""


class Endpoint:
    """Where requests go: a base URL's scheme, host, port and path prefix."""

    def __init__(self, base_url: str):
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(
                f"the base URL must be http://HOST[:PORT] or https://...; got {base_url!r}"
            )
        self.tls = url.scheme == "https"
        self.host = url.hostname
        self.port = url.port or (443 if self.tls else 80)
        self.host_header = url.netloc.rpartition("@")[2]  # (no user info)
        self.prefix = url.path.rstrip("/")
        self._ssl = ssl.create_default_context() if self.tls else None

    def request(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
        """A POST of a JSON body as bytes on the wire (built before a request's clock starts)."""
        lines = [
            f"POST {self.prefix}{path} HTTP/1.1",
            f"Host: {self.host_header}",
            "Content-Type: application/json",
            "Accept: text/event-stream",
            f"Content-Length: {len(body)}",
            "Connection: close",
            *(f"{name}: {value}" for name, value in (headers or {}).items()),
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    async def send(self, request: bytes, timeout_s: float) -> Response:
        """Connect, send `request`, and return once the response's headers are in."""
        loop = asyncio.get_running_loop()
        response = Response(loop, timeout_s)
        try:
            await asyncio.wait_for(
                loop.create_connection(lambda: response, self.host, self.port, ssl=self._ssl),
                min(timeout_s, _CONNECT_TIMEOUT_S),
            )
        except asyncio.TimeoutError as e:
            raise RequestTimeout(f"no connection to {self.host}:{self.port} in time") from e
        except OSError as e:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {e}") from e
        response.transport.write(request)
        await response.wait_for_headers()
        return response


class Response(asyncio.Protocol):
    """One response as it arrives: `status` once the headers are in, then the body (`lines`
    or `read`). `close` ends the connection, read to its end or not."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float):
        self._loop = loop
        self._timeout_s = timeout_s
        self._parser = httptools.HttpResponseParser(self)
        self._body = bytearray()  # what arrived and was not taken yet
        self._waiter: asyncio.Future | None = None
        self.transport: asyncio.Transport | None = None
        self.status: int | None = None
        self.complete = False
        self.error: Exception | None = None

    # ---- the connection (asyncio.Protocol) ---------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ConnectionClosed(f"the response is not valid HTTP/1.1: {e}"))
        self._wake()

    def eof_received(self) -> bool:
        self._ended()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended()

    # ---- the parser's callbacks ---------------------------------------------------------
    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.complete = True

    # ---- reading ------------------------------------------------------------------------
    async def wait_for_headers(self) -> None:
        while self.status is None:
            await self._more()

    async def lines(self):
        """The body's lines as text, without their line ends, as they arrive."""
        body = self._body
        while True:
            end = body.find(b"\n")
            while end >= 0:
                line = bytes(body[:end])
                del body[: end + 1]
                yield (line[:-1] if line.endswith(b"\r") else line).decode()
                end = body.find(b"\n")
            if self.complete:
                if body:
                    yield bytes(body).decode()
                    body.clear()
                return
            await self._more()

    async def read(self) -> bytes:
        """The rest of the body, whole (what came, when the connection ended early)."""
        try:
            while not self.complete:
                await self._more()
        except ConnectionClosed:
            pass  # (a body ended by the connection: an error page says what it can)
        out = bytes(self._body)
        self._body.clear()
        return out

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def _more(self) -> None:
        """Wait for more of the response (raises what ended it instead)."""
        if self.error is not None:
            raise self.error
        self._waiter = self._loop.create_future()
        timer = self._loop.call_later(self._timeout_s, self._timed_out)
        try:
            await self._waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self.error is not None:
            raise self.error

    def _timed_out(self) -> None:
        self._fail(RequestTimeout(f"the server sent nothing for {self._timeout_s:g} s"))
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def _ended(self) -> None:
        if not self.complete:
            self._fail(
                ConnectionClosed("the server closed the connection before the response ended")
            )
        self._wake()

    def _fail(self, error: Exception) -> None:
        if self.error is None and not self.complete:
            self.error = error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
