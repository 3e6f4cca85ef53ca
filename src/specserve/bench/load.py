"""The asyncio load generator: streams requests to an OpenAI-compatible server and times them.

Arrivals follow a Poisson process at `request_rate` (all at once when it is infinite) and at
most `max_concurrency` requests are in flight. Each request streams (SSE) with
`stream_options.include_usage`, so token counts come from the server's usage chunk. Time to
first token (TTFT) is the time to the first chunk carrying text, as other servers'
benchmarks take it: a server holds back the text of a token that ends inside a UTF-8
character or is a special token, so the first text can come some tokens after the first
token. Inter-token latencies are the gaps between successive chunks carrying text: one
chunk may carry several tokens (speculative decoding, text held back a step or more), so
TPOT, computed from the token count, is the per-token figure. A failure of any kind
(HTTP status, an error event in the stream, a broken connection, a timeout) is recorded with
its kind and never stops the run.

A multi-turn conversation is one closed-loop user: it holds one slot of `max_concurrency`
from its first turn to its last, and each turn is sent once the previous answer is in, with
that answer in its history. After a failed turn the rest of its conversation is recorded as
not sent (their history would lack an answer).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from specserve.bench.conversations import Conversation
from specserve.bench.datasets import BenchPrompt

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PREFIX_SEPARATOR = "\n\n"  # completions: between the shared prefix and the prompt
NOT_SENT = "not sent (an earlier turn failed)"


def normalize_base_url(url: str) -> str:
    """'http://host:port', whatever trailing '/' or '/v1' the user typed."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class LoadConfig:
    """What to send and how fast. `request_rate` is requests per second (inf: all at once)."""

    base_url: str
    model: str | None = None
    endpoint: str = "completions"
    max_concurrency: int | None = None
    request_rate: float = math.inf
    ignore_eos: bool = False
    temperature: float = 0.0
    api_key: str | None = None
    timeout_s: float = 600.0
    seed: int = 0
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.base_url = normalize_base_url(self.base_url)
        if self.endpoint not in ENDPOINTS:
            raise ValueError(
                f"endpoint must be one of {', '.join(ENDPOINTS)}; got {self.endpoint!r}"
            )
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1; got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0; got {self.request_rate}")
        url = urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(
                f"the base URL must be http://HOST[:PORT] or https://...; got {self.base_url!r}"
            )


@dataclass
class RequestResult:
    """What one request did. Times are seconds; `start_s` is from the start of the run."""

    ok: bool = False
    error: str | None = None  # the kind: "HTTP 429", "stream error (server_error)", "timeout"
    error_message: str | None = None
    prompt_tokens: int | None = None  # from the usage chunk
    # usage.prompt_tokens_details.cached_tokens: None when the server did not report it
    cached_prompt_tokens: int | None = None
    output_tokens: int = 0  # usage's completion_tokens, else text chunks counted
    usage_reported: bool = False
    turn: int = 0  # its turn in a multi-turn conversation (0-based); 0 for a single request
    start_s: float = 0.0
    ttft_s: float | None = None
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_text: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def request_body(cfg: LoadConfig, p: BenchPrompt) -> dict:
    body: dict = {
        "model": cfg.model,
        "max_tokens": p.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        messages = (
            p.prompt if isinstance(p.prompt, list) else [{"role": "user", "content": p.prompt}]
        )
        body["messages"] = _with_system_prefix(messages, p.prefix) if p.prefix else messages
    else:
        if isinstance(p.prompt, list):
            raise ValueError("chat conversations need --endpoint chat")
        body["prompt"] = p.prefix + PREFIX_SEPARATOR + p.prompt if p.prefix else p.prompt
    if cfg.ignore_eos:  # not an OpenAI field: sent only when asked for
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


def _with_system_prefix(messages: list[dict], prefix: str) -> list[dict]:
    """The messages with the prefix as their system message: in front of the conversation's
    own system message when it has one (chat templates take one, first)."""
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": prefix + PREFIX_SEPARATOR + first["content"]}, *messages[1:]]
    return [{"role": "system", "content": prefix}, *messages]


def _cached_tokens(usage: dict) -> int | None:
    """OpenAI's usage.prompt_tokens_details.cached_tokens; None when absent or null."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else None


def client_session(cfg: LoadConfig) -> aiohttp.ClientSession:
    """The load generator's HTTP client: aiohttp, whose C parser costs the client's one event
    loop ~0.4 ms a streamed request and ~0.05-0.07 ms an event, where httpx (pure Python)
    took ~1.9 and ~0.1 (2-core CPU, a stub server, 2 kB prompts): a closed loop's wave of 16
    new requests spent ~30 ms of the loop in turn inside the TTFTs reported (issue 31). A
    connection per request, closed at its end, as the published figures were measured (a
    kept connection made the load itself slower: 223b995); `timeout_s` bounds each wait for
    the server (connecting: at most 30 s), not the whole request."""
    timeout = aiohttp.ClientTimeout(
        total=None, connect=min(cfg.timeout_s, 30.0), sock_read=cfg.timeout_s
    )
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, read_bufsize=1 << 20, trust_env=False
    )


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):  # (aiohttp's read and connect timeouts too)
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connection refused"
    if isinstance(exc, (aiohttp.ClientError, ConnectionError)):
        return "connection closed"
    if isinstance(exc, json.JSONDecodeError):
        return "bad JSON in stream"
    return type(exc).__name__


def _chunk_text(obj: dict, chat: bool) -> str:
    parts = []
    for choice in obj.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if chat:
            parts.append((choice.get("delta") or {}).get("content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


def _finished(obj: dict) -> bool:
    """Whether a chunk ends a choice (a finish_reason)."""
    return any(isinstance(c, dict) and c.get("finish_reason") for c in obj.get("choices") or [])


async def send_request(
    client: aiohttp.ClientSession, cfg: LoadConfig, p: BenchPrompt, run_start: float
) -> RequestResult:
    """Stream one request; never raises for a server or network failure."""
    r = RequestResult()
    chat = cfg.endpoint == "chat"
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    chunks = 0
    done = finished = False
    try:
        # Built (its JSON encoded) before the clock starts: the client's own work is no
        # part of the server's latency (~0.2 ms for a 2,112-token prompt on a small CPU).
        body = json.dumps(
            request_body(cfg, p), ensure_ascii=False, separators=(",", ":"), allow_nan=False
        ).encode()
    except ValueError as e:
        r.error, r.error_message = _error_kind(e), f"{type(e).__name__}: {e}"[:500]
        return r
    t0 = time.perf_counter()
    r.start_s = t0 - run_start
    last = t0
    try:
        async with client.post(
            cfg.base_url + ENDPOINTS[cfg.endpoint], data=body, headers=headers
        ) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                r.error, r.error_message = f"HTTP {resp.status}", text[:500]
                return r
            async for raw in resp.content:  # (lines, as they arrive)
                if not raw.startswith(b"data:"):
                    continue
                payload = raw[5:].strip().decode()
                if payload == "[DONE]":
                    done = True
                    break
                obj = json.loads(payload)
                if not isinstance(obj, dict):  # (an event no OpenAI server sends)
                    r.error, r.error_message = "stream event not an object", payload[:500]
                    return r
                if "error" in obj:
                    err = obj["error"] if isinstance(obj["error"], dict) else {}
                    r.error = f"stream error ({err.get('code') or err.get('type') or 'error'})"
                    r.error_message = json.dumps(obj)[:500]
                    return r
                text = _chunk_text(obj, chat)
                finished = finished or _finished(obj)
                now = time.perf_counter()
                if text:
                    chunks += 1
                    if r.ttft_s is None:
                        r.ttft_s = now - t0
                    else:
                        r.itl_s.append(now - last)
                    last = now
                    r.output_text += text
                usage = obj.get("usage")
                if usage and isinstance(usage, dict):
                    r.usage_reported = True
                    r.prompt_tokens = usage.get("prompt_tokens")
                    r.cached_prompt_tokens = _cached_tokens(usage)
                    r.output_tokens = usage.get("completion_tokens") or 0
        if not (done or finished):  # (a server that ends its streams without [DONE] after
            r.error, r.error_message = "stream ended before [DONE]", None  # a finish_reason:
            return r  # vLLM's bench takes those as complete too)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
        r.error, r.error_message = _error_kind(e), f"{type(e).__name__}: {e}"[:500]
        return r
    finally:
        r.latency_s = time.perf_counter() - t0
    if not r.usage_reported:
        r.output_tokens = chunks
    r.ok = True
    return r


async def send_conversation(
    client: aiohttp.ClientSession,
    cfg: LoadConfig,
    conversation: Conversation,
    run_start: float,
    on_done: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Every turn of the conversation, one after another, each with the answers so far; a
    result per turn (after a failed turn, NOT_SENT for the rest)."""
    chat = cfg.endpoint == "chat"
    answers: list[str] = []
    results: list[RequestResult] = []
    for turn in range(conversation.turns):
        if results and not results[-1].ok:
            failed = results[-1]
            r = RequestResult(error=NOT_SENT, error_message=f"turn {failed.turn}: {failed.error}")
        else:
            p = conversation.turn_prompt(turn, answers, chat)
            r = await send_request(client, cfg, p, run_start)
            answers.append(r.output_text)
        r.turn = turn
        results.append(r)
        if on_done is not None:
            on_done(r)
    return results


async def run_load(
    cfg: LoadConfig,
    prompts: list[BenchPrompt | Conversation],
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every prompt, and every turn of every conversation; returns the results (in
    prompt order, a conversation's turns in turn order) and the run's duration. Arrivals and
    the concurrency limit count conversations, not turns."""
    limit = cfg.max_concurrency or len(prompts)
    async with client_session(cfg) as client:
        return await _run(client, cfg, prompts, limit, on_done)


async def _run(
    client: aiohttp.ClientSession,
    cfg: LoadConfig,
    prompts: list[BenchPrompt | Conversation],
    limit: int,
    on_done: Callable[[RequestResult], None] | None,
) -> tuple[list[RequestResult], float]:
    semaphore = asyncio.Semaphore(limit)
    rng = random.Random(cfg.seed)
    run_start = time.perf_counter()

    async def one(p: BenchPrompt) -> RequestResult:
        async with semaphore:
            result = await send_request(client, cfg, p, run_start)
        if on_done is not None:
            on_done(result)
        return result

    async def user(c: Conversation) -> list[RequestResult]:
        async with semaphore:  # one slot for the whole conversation
            return await send_conversation(client, cfg, c, run_start, on_done)

    tasks = []
    arrival = 0.0  # (seconds from the start: each arrival by the clock, not after the last
    for i, p in enumerate(prompts):  # one's sleep, whose overshoot would add up, lowering
        if i and math.isfinite(cfg.request_rate):  # the rate by a busy loop's share)
            arrival += rng.expovariate(cfg.request_rate)
            await asyncio.sleep(max(0.0, arrival - (time.perf_counter() - run_start)))
        tasks.append(asyncio.create_task(user(p) if isinstance(p, Conversation) else one(p)))
    done = await asyncio.gather(*tasks)
    duration_s = time.perf_counter() - run_start
    results = [r for item in done for r in (item if isinstance(item, list) else [item])]
    return results, duration_s
