"""What a connection passes before the API sees it.

- `RequestGuard` (ASGI middleware in front of the app): the API key is checked from the
  headers alone, before a byte of the body is read (an unauthenticated 100 MB body gets its
  401 at once and is never buffered); a body larger than the limit is refused while it is
  read (413, by its Content-Length before any byte); the body must arrive within the read
  timeout (408); POSTs to the API with a Content-Type other than JSON or a compressed body
  (Content-Encoding) get 415 (no Content-Type given is read as JSON). The key
  is compared in constant time. /health is always open, /metrics when asked.
- `guarded_http` (uvicorn's HTTP protocol: httptools' C parser where it is installed, else
  h11): a connection whose request headers do not arrive within the read timeout is closed.
  uvicorn times only idle kept-alive connections, so a client trickling headers (slowloris)
  would hold its socket, and a shutdown, forever.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable

OPEN_PATHS = frozenset({"/health"})
API_PREFIX = "/v1/"
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_DRAIN_POLL_S = 0.5  # how often a body read checks for a shutdown


class RequestGuard:
    """Authentication, size, time and media-type checks of every HTTP request (see the
    module); everything that passes reaches `app` with its body already read."""

    def __init__(
        self,
        app,
        api_key: str | None,
        public_metrics: bool,
        max_body_bytes: int,
        read_timeout_s: float,
        draining: Callable[[], bool] = lambda: False,
    ):
        self.app = app
        self.draining = draining  # a server shutting down stops waiting for slow bodies
        self.expected = api_key.encode() if api_key else None
        self.open_paths = self.open_paths_for(public_metrics)
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if self.expected is not None and path not in self.open_paths:
            if not self._authorized(scope):
                await _reply(
                    send,
                    401,
                    "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                    "authentication_error",
                    "invalid_api_key",
                    [(b"www-authenticate", b"Bearer")],
                )
                return
        if scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(send)
            return
        if path.startswith(API_PREFIX):
            content_type = headers.get(b"content-type")
            if content_type is None:  # read as JSON, as clients that send none mean it
                scope = {
                    **scope,
                    "headers": [*scope["headers"], (b"content-type", b"application/json")],
                }
            elif not _is_json(content_type):
                await _reply(
                    send,
                    415,
                    "send the body as JSON with 'Content-Type: application/json'",
                    "invalid_request_error",
                    "unsupported_media_type",
                )
                return
            encoding = headers.get(b"content-encoding", b"identity").strip().lower()
            if encoding != b"identity":  # (a gzipped body read as JSON: a misleading 400)
                await _reply(
                    send,
                    415,
                    f"Content-Encoding {encoding.decode('latin-1')!r} is not supported; send "
                    "the body uncompressed",
                    "invalid_request_error",
                    "unsupported_media_type",
                )
                return
        body = await self._read_body(receive, send)
        if body is None:
            return  # answered already, or the client left
        await self.app(scope, _replay(body, receive), send)

    @staticmethod
    def open_paths_for(public_metrics: bool) -> frozenset[str]:
        """The paths served without the API key."""
        return OPEN_PATHS | ({"/metrics"} if public_metrics else frozenset())

    def _authorized(self, scope) -> bool:
        """The Authorization header carries the key: scheme "Bearer" in any case (RFC 7235),
        the token compared in constant time."""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    token.strip(), self.expected
                )
        return False

    async def _read_body(self, receive, send) -> bytes | None:
        """The whole body, or None after answering 413 / 408 (or when the client left)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s
        chunks, size = [], 0
        pending = None
        while True:
            if pending is None:
                pending = asyncio.ensure_future(receive())
            left = deadline - loop.time()
            if left > 0 and not self.draining():
                done, _ = await asyncio.wait({pending}, timeout=min(left, _DRAIN_POLL_S))
                if not done:
                    continue
            if not pending.done():
                pending.cancel()
                if self.draining():
                    await _reply(
                        send, 503, "the server is shutting down", "server_error", "shutting_down"
                    )
                else:
                    await _reply(
                        send,
                        408,
                        f"the request body did not arrive within {self.read_timeout_s:g} s",
                        "invalid_request_error",
                        "request_timeout",
                    )
                return None
            message, pending = pending.result(), None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send) -> None:
        await _reply(
            send,
            413,
            f"the request body is larger than {self.max_body_bytes} bytes (--max-request-bytes)",
            "invalid_request_error",
            "request_too_large",
        )


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or media.endswith(b"+json")


def _replay(body: bytes, receive):
    """A receive that hands the app the body read already, then the connection's own
    messages (a disconnect while the response streams)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reply(
    send, status: int, message: str, type: str, code: str, headers: list[tuple[bytes, bytes]] = ()
) -> None:
    """An OpenAI-style error body; the connection closes after it (an unread body stays
    unread)."""
    body = json.dumps(
        {"error": {"message": message, "type": type, "param": None, "code": code}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def http_protocol_base() -> type:
    """uvicorn's HTTP/1.1 protocol class: httptools' (a C parser, a fraction of h11's CPU per
    streamed event) where that package is installed, else the pure-Python h11 one."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    return HttpToolsProtocol


def guarded_http(read_timeout_s: float, base: type | None = None) -> type:
    """`base` (default `http_protocol_base()`), closing a connection whose request headers
    (the first request's, or a kept-alive connection's next) do not arrive within
    read_timeout_s. Both of uvicorn's protocols start a request's cycle once its headers are
    parsed and mark it complete with the response."""
    base = base or http_protocol_base()

    class GuardedProtocol(base):
        _headers_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._headers_done():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self._headers_done():
                self._arm()  # the next request's headers

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _headers_done(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._headers_timer = self.loop.call_later(read_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
                self._headers_timer = None

        def _headers_late(self) -> None:
            self._headers_timer = None
            if not self._headers_done() and not self.transport.is_closing():
                self.transport.close()

    GuardedProtocol.__name__ = f"Guarded{base.__name__}"
    return GuardedProtocol
