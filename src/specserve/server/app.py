"""FastAPI routes of the OpenAI-compatible API, /health and /metrics.

The routes validate and tokenize, hand engine requests to the EngineClient and turn its
delta streams into responses: whole JSON bodies or server-sent events ending in [DONE].
A client that disconnects has its engine requests aborted at once (streams: Starlette
cancels the body iterator; whole responses: a watcher waits for http.disconnect). A client
that stays connected but stops reading its stream is stopped too: by the output waiting
for it (EngineClient) or by a write that waits past `stream_write_timeout_s` (its
connection is closed, `_watch_writes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from specserve.server.config import ServerConfig
from specserve.server.engine_client import (
    EngineClient,
    EngineDeadError,
    EngineRequestError,
    EngineStalledError,
    QueueFullError,
    RequestTooBigError,
    ShuttingDownError,
    SlowReaderError,
)
from specserve.server.errors import APIError, install_error_handlers
from specserve.server.guard import RequestGuard
from specserve.server.inputs import InputProcessor, PreparedRequest, model_check
from specserve.server.metrics import ServerMetrics
from specserve.server.openai_format import (
    SSE_DONE,
    ChatFormatter,
    CompletionFormatter,
    TokenText,
    sse,
)
from specserve.server.openapi import document_openapi, errors, generation_responses
from specserve.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    NamedToolChoice,
)
from specserve.server.request_stream import RequestStream

log = logging.getLogger("specserve.server")
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
_WATCH_WRITES_S = 1.0  # how often waiting writes are checked
RECEIVED_AT = "specserve.received_at"  # scope key: when an API request reached the app


@dataclass
class ServerState:
    """What the routes share: the engine client and everything needed to serve requests."""

    config: ServerConfig
    client: EngineClient
    inputs: InputProcessor
    metrics: ServerMetrics
    token_text: TokenText
    served_names: list[str]
    draining: bool = False  # set on SIGTERM: new API requests get 503
    loop: asyncio.AbstractEventLoop | None = None
    # Closes the connection of a client address at once, unsent bytes dropped; False
    # where it cannot (set by launch.py from uvicorn's connections)
    close_connection: Callable[[tuple | None], bool] | None = None
    streaming: set[_EngineStream] = field(default_factory=set)  # responses being written

    def begin_shutdown(self) -> None:
        """On SIGTERM (any thread): refuse new API requests now, abort the ones still
        running once the shutdown timeout has passed, so every response ends cleanly."""
        if self.draining:
            return
        self.draining = True
        if self.loop is not None:
            err = ShuttingDownError("the server shut down before the request finished")
            self.loop.call_soon_threadsafe(
                self.loop.call_later, self.config.shutdown_timeout_s, self.client.abort_all, err
            )


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.client.attach(state.loop)
        watcher = state.loop.create_task(_watch_writes(state))
        yield
        watcher.cancel()
        await state.client.shutdown()
        state.inputs.close()

    app = FastAPI(title="specserve", version="0.1.0", lifespan=lifespan)
    created = int(time.time())
    install_error_handlers(app)
    cfg = state.config
    # Outermost last: the status counter sees what the guard refuses too.
    app.add_middleware(
        RequestGuard,
        api_key=cfg.api_key,
        public_metrics=cfg.public_metrics,
        max_body_bytes=cfg.max_request_bytes,
        read_timeout_s=cfg.request_read_timeout_s,
        draining=lambda: state.draining,
    )
    app.add_middleware(_StatusCounter, metrics=state.metrics)
    state.metrics.engine_stats = lambda: state.client.stats
    state.metrics.in_flight = lambda: state.client.num_in_flight
    state.metrics.engine_silent_s = lambda: state.client.watch.silent_s_at(time.monotonic())
    state.metrics.prompt_stats = state.inputs.encoder.stats

    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "the engine runs", "content": {}}, **errors(503)},
    )
    async def health() -> Response:
        problem = state.client.problem()
        if problem is not None:  # dead, or stopped or hung: the message says which
            code = "engine_unresponsive" if state.client.alive else "engine_unavailable"
            return APIError(503, problem, code=code).response()
        return Response(status_code=200)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            200: {
                "description": "Prometheus text exposition format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **errors(401),
        },
    )
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def card(name: str) -> dict:
        info = state.client.info
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "specserve",
            # (the most tokens a request can hold: the context, or less where the KV
            # cache is smaller)
            "max_model_len": min(info.max_model_len, info.kv_capacity_tokens),
        }

    @app.get("/v1/models", response_model=ModelList, responses=errors(401))
    async def models() -> dict:
        return {"object": "list", "data": [card(name) for name in state.served_names]}

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=errors(401, 404))
    async def model(model: str) -> dict:
        return card(model_check(model, state.served_names))

    @app.post(
        "/v1/completions",
        response_model=None,
        responses=generation_responses(CompletionResponse, CompletionResponse),
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model = model_check(body.model, state.served_names)
        prompts = await state.inputs.completion_prompts(body)
        score_only = body.max_tokens == 0  # (with echo: one token is drawn, none returned)
        prepared = state.inputs.prepare(
            "cmpl", body, prompts, 1 if score_only else body.max_tokens, "max_tokens", body.logprobs
        )
        fmt = CompletionFormatter(
            prepared.request_id,
            model,
            len(prepared.requests),
            prepared.num_prompt_tokens,
            body.logprobs,
            state.token_text,
        )
        await state.inputs.check_grammar(prepared)
        fmt.per_prompt = len(prepared.requests) // len(prompts)
        if body.echo:
            texts = [state.inputs.prompt_text(body, i, ids) for i, ids in enumerate(prompts)]
            offsets: list = [None] * len(texts)
            if body.logprobs is not None:  # (the texts encoded again: off the event loop)
                offsets = await asyncio.to_thread(
                    lambda: list(map(state.inputs.prompt_offsets, texts, prompts))
                )
            fmt.echo = list(zip(texts, prompts, offsets))
            fmt.score_only = score_only
        fmt.simulated = state.client.info.simulated_acceptance
        return await _serve(state, request, body, prepared, fmt)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses=generation_responses(ChatCompletionResponse, ChatCompletionChunk),
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        model = model_check(body.model, state.served_names)
        ids = await state.inputs.chat_prompt(body)
        if body.max_completion_tokens is not None:
            asked, param = body.max_completion_tokens, "max_completion_tokens"
        else:
            asked, param = body.max_tokens, "max_tokens"
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prepared = state.inputs.prepare(
            "chatcmpl", body, [ids], asked, param, logprobs, prompt_param="messages"
        )
        fmt = ChatFormatter(
            prepared.request_id,
            model,
            len(prepared.requests),
            prepared.num_prompt_tokens,
            logprobs,
            state.token_text,
        )
        await state.inputs.check_grammar(prepared)
        fmt.per_prompt = len(prepared.requests)  # one prompt, n choices
        if body.tools and body.tool_choice != "none":
            fmt.tools_format = state.inputs.tool_format
            fmt.most_calls = 1 if body.parallel_tool_calls is False else None
            fmt.forced_call = body.tool_choice == "required" or isinstance(
                body.tool_choice, NamedToolChoice
            )
        fmt.simulated = state.client.info.simulated_acceptance
        return await _serve(state, request, body, prepared, fmt)

    document_openapi(
        app,
        secured=cfg.api_key is not None,
        open_paths=RequestGuard.open_paths_for(cfg.public_metrics),
        models=(ChatCompletionChunk,),
    )
    return app


async def _serve(
    state: ServerState, request: Request, body, prepared: PreparedRequest, fmt
) -> Response:
    if state.draining:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    try:
        stream = state.client.submit(prepared.requests, prepared.num_prompt_tokens)
    except QueueFullError as e:
        raise APIError(
            429, str(e), code="queue_full", headers={"Retry-After": str(state.config.retry_after_s)}
        ) from e
    except RequestTooBigError as e:
        param = "n" if body.n > 1 else "prompt"
        raise APIError(400, str(e), param=param, code="too_many_choices") from e
    except EngineDeadError as e:
        raise _unavailable(e) from e
    if body.stream:
        outside = state.metrics.ttft_outside
        received = request.scope.get(RECEIVED_AT)
        if received is not None:
            outside.labels("intake").observe(stream.submitted_at - received)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        try:
            return _EngineStream(
                state,
                stream,
                _events(stream, fmt, include_usage, outside.labels("first_chunk")),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        except BaseException:  # (it would count toward admission until released)
            state.client.release(stream)
            raise
    try:
        await _collect(stream, fmt, request)
    finally:
        state.client.release(stream)  # frees pages on disconnect/cancel
    return JSONResponse(fmt.response())


async def _collect(stream: RequestStream, fmt, request: Request) -> None:
    """Absorb every delta, or give up as soon as the client disconnects."""

    async def consume() -> None:
        async for index, delta in stream:
            fmt.add(index, delta)

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (consumer, watcher):
            if not task.done():
                task.cancel()
    if not consumer.done() or consumer.cancelled():
        raise APIError(499, "the client closed the request")
    _reraise(consumer.exception())


def _reraise(exc: BaseException | None) -> None:
    if exc is None:
        return
    if isinstance(exc, EngineRequestError):
        raise APIError(exc.status, str(exc), param=exc.field) from exc
    if isinstance(exc, EngineDeadError):
        raise _unavailable(exc) from exc
    raise exc


def _unavailable(exc: EngineDeadError) -> APIError:
    if isinstance(exc, ShuttingDownError):
        code = "shutting_down"
    elif isinstance(exc, EngineStalledError):
        code = "engine_unresponsive"
    else:
        code = "engine_unavailable"
    return APIError(503, str(exc), code=code)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(
    stream: RequestStream, fmt, include_usage: bool, first_chunk_s=None
) -> AsyncIterator[bytes]:
    """The stream's events; `first_chunk_s` (a histogram) observes the time from the server
    handling the first tokens to their event written (the generator resumes once it is)."""
    if isinstance(fmt, ChatFormatter):
        for chunk in fmt.role_chunks(include_usage):
            yield sse(chunk)
    timed = first_chunk_s is None
    try:
        async for index, delta in stream:
            chunks = fmt.chunks(index, delta, include_usage)
            for chunk in chunks:
                yield sse(chunk)
            if chunks:
                if not timed and delta.new_token_ids and stream.first_token_at is not None:
                    first_chunk_s.observe(time.monotonic() - stream.first_token_at)
                    timed = True
    except EngineRequestError as e:
        yield sse(APIError(e.status, str(e), param=e.field).body())
    except EngineDeadError as e:
        yield sse(_unavailable(e).body())
    except SlowReaderError as e:  # (written if the client reads again)
        yield sse(APIError(408, str(e), code="slow_reader").body())
    else:
        if include_usage:
            yield sse(fmt.usage_chunk())
    yield SSE_DONE


class _EngineStream(StreamingResponse):
    """A streaming response that aborts its engine requests however it ends (finished,
    client gone, cancelled by shutdown, closed for a client that reads nothing), so their
    KV pages are freed at once. It stamps the time a write to the client begins waiting
    (`RequestStream.sending_since`), which the backlog bound and `_watch_writes` read."""

    def __init__(self, state: ServerState, stream: RequestStream, content, **kwargs):
        super().__init__(content, **kwargs)
        self._state = state
        self._stream = stream
        self._task: asyncio.Task | None = None
        self._closed = False  # cancelled by `close`

    async def __call__(self, scope, receive, send) -> None:
        stream = self._stream
        stream.client = scope.get("client")

        async def timed_send(message) -> None:
            stream.sending_since = time.monotonic()
            try:
                await send(message)
            finally:
                stream.sending_since = None

        self._task = asyncio.current_task()
        self._state.streaming.add(self)
        try:
            await super().__call__(scope, receive, timed_send)
        except asyncio.CancelledError:
            if not self._closed:
                raise
            self._task.uncancel()  # (ours: the response ends; uvicorn drops the connection)
        finally:
            self._state.streaming.discard(self)
            self._state.client.release(stream)

    def write_stalled(self, now: float, limit_s: float) -> bool:
        since = self._stream.sending_since
        return since is not None and now - since > limit_s

    def close(self, why: str) -> None:
        """Stop it: its requests are aborted and its connection closed at once (uvicorn
        then tells the response its client left), or, where that cannot be done, the
        response is cancelled."""
        client = self._stream.client
        address = f"{client[0]}:{client[1]}" if client else "a client"
        log.warning("closing the stream of %s: %s", address, why)
        self._state.streaming.discard(self)
        self._state.client.release(self._stream)
        closer = self._state.close_connection
        if closer is None or not closer(self._stream.client):
            self._closed = True
            if self._task is not None:
                self._task.cancel()


async def _watch_writes(state: ServerState) -> None:
    """Every second: a stream whose write to its client has waited longer than
    `stream_write_timeout_s` (the client reads nothing, or has vanished without closing)
    is stopped and its connection closed."""
    limit_s = state.config.stream_write_timeout_s
    while True:
        await asyncio.sleep(_WATCH_WRITES_S)
        now = time.monotonic()
        for response in [r for r in state.streaming if r.write_stalled(now, limit_s)]:
            state.metrics.streams_stopped.labels("write_timeout").inc()
            response.close(f"its client read nothing for {limit_s:.0f} s")


class _StatusCounter:
    """ASGI middleware counting API requests by endpoint and final HTTP status; the first of
    specserve's to see a request, it stamps its arrival (RECEIVED_AT)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        scope[RECEIVED_AT] = time.monotonic()  # (the intake part of the TTFT outside it)
        status = 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            endpoint = path if path in _ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint, str(status)).inc()
