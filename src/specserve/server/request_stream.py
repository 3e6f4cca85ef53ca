"""One API request's engine outputs as the HTTP process hands them to its response: an
async stream of (choice index, OutputDelta) whose undelivered backlog is counted, and
deltas of one choice that queued up behind each other merged into one."""

from __future__ import annotations

import asyncio

from specserve.server.messages import OutputDelta

END = object()  # put after a stream's last delta: it ends there


class RequestStream:
    """Async iterator over (choice index, OutputDelta) of one API request's engine requests
    (one per choice); ends when every one has finished.

    Deltas of one choice that queued up behind each other (the HTTP process fell behind the
    engine: a fast model's one-token steps arrive faster than events go out) come out as
    one (`merge_deltas`): one event instead of several, the same text, tokens and logprobs.

    `backlog_bytes` estimates the memory its deltas hold until its consumer takes them.
    `sending_since` and `client` are its response's: since when its write to the client
    has been waiting (None while none waits), and the client's address. A client that
    does not read blocks the consumer in that write while deltas pile up: EngineClient
    stops a stream whose backlog passes its bound while a write waits (`cut`).
    """

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        self.unfinished = set(request_ids)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._next = None  # an item taken from the queue while merging, not yet returned
        self.submitted_at: float | None = None  # (time.monotonic, as every stamp here)
        self.first_token_at: float | None = None  # when the server handled its first tokens
        self.backlog_bytes = 0
        self.sending_since: float | None = None
        self.client: tuple | None = None

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def _put(self, item) -> None:
        if type(item) is tuple:
            self.backlog_bytes += delta_bytes(item[1])
        self._queue.put_nowait(item)

    def _take(self, item):
        if type(item) is tuple:
            self.backlog_bytes -= delta_bytes(item[1])
        return item

    def cut(self, exc: BaseException) -> None:
        """Drop the deltas not yet taken (their memory); the consumer gets `exc` next."""
        self._next = None
        while not self._queue.empty():
            self._queue.get_nowait()
        self.backlog_bytes = 0
        self._queue.put_nowait(exc)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, OutputDelta]:
        item, self._next = self._next, None
        if item is None:
            item = self._take(await self._queue.get())
        if item is END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        queue = self._queue
        if queue.empty():
            return item
        index, delta = item
        parts = [delta]
        while not queue.empty():
            more = self._take(queue.get_nowait())
            if more is END or isinstance(more, BaseException) or more[0] != index:
                self._next = more
                break
            parts.append(more[1])
        return index, merge_deltas(parts)


def delta_bytes(delta: OutputDelta) -> int:
    """About the memory an OutputDelta received from the engine holds (measured on
    CPython 3.11: ~440 bytes a delta, ~200 more a token with logprobs and ~100 a top
    alternative, prompt tokens' included)."""
    n = len(delta.new_token_ids)
    size = 400 + len(delta.delta_text) + 40 * n
    if delta.new_logprobs:
        size += n * (200 + 100 * len(delta.new_logprobs[0][1]))
    prompt = delta.prompt_logprobs
    if prompt and len(prompt) > 1:  # (the first token's is None)
        size += len(prompt) * (200 + 100 * len(prompt[1][1]))
    return size


def merge_deltas(parts: list[OutputDelta]) -> OutputDelta:
    """Consecutive deltas of one engine request as one: texts, tokens and logprobs joined,
    the last one's finish."""
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    logprobs = None
    if parts[0].new_logprobs is not None:
        logprobs = [lp for p in parts for lp in p.new_logprobs]
    return OutputDelta(
        last.request_id,
        "".join(p.delta_text for p in parts),
        [t for p in parts for t in p.new_token_ids],
        logprobs,
        last.finished,
        last.finish_reason,
        next((p.spec_stats for p in reversed(parts) if p.spec_stats is not None), None),
        last.num_cached_tokens,
        next((p.prompt_logprobs for p in parts if p.prompt_logprobs is not None), None),
    )
