"""The HTTP process's side of the engine: spawns the engine process, sends it requests and
routes its per-step reports to per-request async streams.

A reader thread blocks on the engine's pipe and hands each report to the event loop with
`call_soon_threadsafe`, so the loop never blocks on the engine and the engine never waits
for HTTP work. Requests go the other way through the engine's inbox (server/inbox.py),
written by the event loop itself at once and never blocking it.

Two bounds keep a stuck party from holding the server: a stream's output waiting for its
client to read it is bounded (`RequestStream`; past the bound its requests are aborted),
and the engine reports at least every second (idle or not: engine_proc.py's heartbeat), so
an engine that falls silent (stopped, hung) is noticed: /health says so and the requests
in flight fail (`EngineWatch`).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from specserve.core.config import EngineConfig
from specserve.core.errors import CheckpointError, SpecserveError
from specserve.runtime.grammar import GrammarHandOver
from specserve.server.config import ServerConfig
from specserve.server.engine_proc import run_engine
from specserve.server.engine_watch import EngineWatch
from specserve.server.inbox import InboxWriter
from specserve.server.messages import (
    AbortRequests,
    AddRequest,
    AddRequests,
    Dead,
    EngineInfo,
    Fatal,
    LoadFailed,
    OutputDelta,
    RequestError,
    Shutdown,
    StepReport,
    Stopped,
)
from specserve.server.metrics import ServerMetrics
from specserve.server.request_stream import END, RequestStream

log = logging.getLogger("specserve")
_CAUSE_CHARS = 300  # of an engine's error, what clients are told
_WATCH_S = 1.0  # how often the engine's silence is checked


class EngineDeadError(SpecserveError):
    """The engine process stopped or crashed; requests in flight cannot finish."""


class ShuttingDownError(EngineDeadError):
    """The server shut down (SIGTERM past --shutdown-timeout) before the request finished."""


class QueueFullError(SpecserveError):
    """More requests wait for the engine than --max-queue allows; retry later."""


class RequestTooBigError(SpecserveError):
    """One API request fans out into more engine requests than the server can ever hold
    (running slots plus --max-queue): retrying cannot help."""


class EngineStalledError(EngineDeadError):
    """The engine process has stopped answering (stopped or hung, not dead): requests in
    flight cannot be expected to finish."""


class SlowReaderError(SpecserveError):
    """A stream's client read its output too slowly: more waited undelivered than a stream
    may hold, so its engine requests were aborted."""


class EngineRequestError(SpecserveError):
    """The engine refused a request when it was added (relayed RequestError)."""

    def __init__(self, err: RequestError):
        super().__init__(err.message)
        self.field = err.field
        self.status = err.status


@dataclass
class _Tracked:
    """Routing and latency bookkeeping of one engine request."""

    stream: RequestStream
    index: int
    arrival: float
    last_token_at: float | None = None


class EngineClient:
    """Owns the engine process; `submit` returns a RequestStream, `abort` cancels one."""

    def __init__(self, config: EngineConfig, metrics: ServerMetrics, server: ServerConfig):
        self.config = config
        self.metrics = metrics
        self.max_queue = server.max_queue
        self.stream_backlog_bytes = server.stream_backlog_bytes
        ctx = mp.get_context("spawn")
        inbox_conn, inbox_writer = ctx.Pipe(duplex=False)
        self._inbox = InboxWriter(inbox_writer)
        self._conn, child_conn = ctx.Pipe(duplex=False)
        # the engine logs (its start-up phases and their times) as this process does
        level = logging.getLogger("specserve").getEffectiveLevel()
        self._proc = ctx.Process(
            target=run_engine,
            args=(config, inbox_conn, child_conn, level),
            name="specserve-engine",
        )
        try:
            self._proc.start()
        except BaseException:  # (SIGTERM while it spawns: launch.py's start-up handler)
            if self._proc.pid is not None:
                self._proc.kill()
            raise
        child_conn.close()  # so the reader sees EOF when the engine process dies
        inbox_conn.close()  # so the engine sees EOF when this process dies
        self.info: EngineInfo | None = None
        self.stats: dict = {}
        self.dead_reason: str | None = None
        # called in the event loop once the engine process is found dead (the server exits)
        self.on_dead: Callable[[], None] | None = None
        self.shutting_down = False  # the engine was told to stop: its end is no failure
        self._tracked: dict[str, _Tracked] = {}
        # Streams from submission until released (`release`, which their response calls as
        # it ends): one whose engine requests finished but whose output still waits for its
        # client counts toward admission as its requests did (`num_in_flight`).
        self._open: set[RequestStream] = set()
        self._open_requests = 0
        self.watch = EngineWatch(server.engine_silent_timeout_s, server.engine_step_timeout_s)
        self._watcher: asyncio.Task | None = None
        self._stalled = False  # the engine fell silent; the requests in flight have failed
        self._grammars_sent = GrammarHandOver()  # (`_hand_over`)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float = 3600.0) -> EngineInfo:
        """Block until the engine has loaded the model; raise if loading failed."""
        deadline = time.monotonic() + timeout_s
        msg = None
        # (A heartbeat may come first: the engine's outbox thread can time out waiting just
        # as Ready is queued and see the loop started when it wakes: engine_proc.Outbox.)
        while msg is None or isinstance(msg, StepReport):
            while not self._conn.poll(0.2):
                if not self._proc.is_alive():
                    raise EngineDeadError("the engine process exited while loading the model")
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"the engine did not load the model in {timeout_s:.0f} s")
            msg = self._conn.recv()
        if isinstance(msg, LoadFailed):
            self._proc.join(5)
            if msg.user:
                raise CheckpointError(msg.message)
            raise EngineDeadError(f"the engine failed to load the model:\n{msg.traceback}")
        self.info = msg.info
        self.watch.heard(time.monotonic())
        self.stats = {
            "running": 0,
            "waiting": 0,
            "kv_pages_used": 0,
            "kv_pages_total": self.info.kv_pages_total,
            "preemptions": 0,
        }
        return self.info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start routing engine reports into `loop` (call from inside the running loop)."""
        self._loop = loop
        self.watch.resumed_at = time.monotonic()  # (reports since Ready wait in the pipe)
        self._inbox.attach(loop)
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()
        self._watcher = loop.create_task(self._watch_engine())

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort whatever is left, stop the engine process and wait for it."""
        self.shutting_down = True
        if self._watcher is not None:
            self._watcher.cancel()
        if self._proc.is_alive():
            self._inbox.put(Shutdown())
            await asyncio.to_thread(self._proc.join, timeout_s)
        if self._proc.is_alive():  # (it ignores SIGTERM: run_engine)
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 5)
        self._inbox.close()
        self._fail_all(EngineDeadError("the server is shutting down"))
        self.dead_reason = self.dead_reason or "stopped"

    def kill(self, grace_s: float = 5.0) -> None:
        """Stop the engine process without an event loop (start-up failures, final exit)."""
        self._inbox.detach()  # (the event loop has ended, if it ran)
        if self._proc.is_alive() and grace_s > 0:
            self._inbox.put(Shutdown())
            self._proc.join(grace_s)
        if self._proc.is_alive():  # (it ignores SIGTERM: run_engine)
            self._proc.kill()
            self._proc.join(5)
        self._inbox.close()

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self._proc.is_alive()

    # ---- requests -------------------------------------------------------------------------
    def problem(self) -> str | None:
        """Why the engine cannot serve now (dead, stopped or hung), or None."""
        if not self.alive:
            return "the engine is not running"
        return self.watch.problem(time.monotonic())

    @property
    def num_in_flight(self) -> int:
        """Engine requests accepted and not yet finished or not yet delivered."""
        return self._open_requests

    def running_capacity(self) -> int:
        """Engine requests that can run at once. While the engine last reported an empty
        wait queue it can still admit up to max_num_seqs; otherwise what it runs now is its
        capacity (pages are the limit)."""
        if self.stats.get("waiting", 0) > 0:
            return self.stats.get("running", 0)
        return self.info.max_num_seqs

    def waiting_estimate(self) -> int:
        """Engine requests waiting for a running slot."""
        return max(0, self.num_in_flight - self.running_capacity())

    def submit(self, requests: list[AddRequest], prompt_tokens: int | None = None) -> RequestStream:
        """Queue the engine requests of one API request (each prompt's choices), or raise
        QueueFullError when the wait queue cannot take them all now, RequestTooBigError
        when it never could (more than the running slots and the queue together).
        `prompt_tokens`: the request's prompt tokens as its usage counts them (each prompt
        once, whatever its n; default: every engine request's)."""
        if self.dead_reason is not None or not self._proc.is_alive():
            raise EngineDeadError(f"the engine is not running ({self.dead_reason or 'exited'})")
        now = time.monotonic()
        if self._stalled and self.watch.silent(now):  # (`_watch_engine` has failed the rest)
            raise EngineStalledError(self.watch.problem(now))
        most = self.info.max_num_seqs + self.max_queue  # never more, however idle
        if len(requests) > most:
            raise RequestTooBigError(
                f"this request needs {len(requests)} engine requests (prompts x n); the server "
                f"runs at most {self.info.max_num_seqs} at once and queues {self.max_queue} "
                "more: send fewer prompts or a smaller n"
            )
        waiting = max(0, self.num_in_flight + len(requests) - self.running_capacity())
        if waiting > self.max_queue:
            raise QueueFullError(
                f"{self.waiting_estimate()} requests are waiting and this one would add "
                f"{len(requests)} (limit {self.max_queue}); retry later"
            )
        stream = RequestStream([r.request_id for r in requests])
        stream.submitted_at = now
        self._open.add(stream)
        self._open_requests += len(requests)
        for i, r in enumerate(requests):
            self._tracked[r.request_id] = _Tracked(stream, i, now)
            self._hand_over(r)
        if prompt_tokens is None:
            prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self._inbox.put(AddRequests(requests))
        return stream

    def _hand_over(self, request: AddRequest) -> None:
        """A grammar compiled here goes to the engine with the first request that brings it
        (the engine keeps it); later ones send its key alone (`GrammarHandOver`): one
        compiled grammar a request filled the inbox's pipe."""
        grammar = request.params.grammar
        if grammar is not None:
            request.params.grammar = self._grammars_sent.grammar(grammar)

    def abort(self, stream: RequestStream, reason: str = "abort") -> None:
        """Stop a stream's unfinished engine requests; their KV pages are freed at once.
        They count as finished by `reason` (/metrics: "abort", or "error" where the engine
        refused one of them)."""
        ids = [rid for rid in stream.request_ids if rid in self._tracked]
        for rid in ids:
            del self._tracked[rid]
            self.metrics.finished.labels(reason).inc()
        stream.unfinished.clear()
        if ids and self._proc.is_alive():
            self._inbox.put(AbortRequests(ids))

    def release(self, stream: RequestStream) -> None:
        """The stream's response has ended, however it ended (or its output was dropped):
        what is unfinished is aborted, and it no longer counts toward admission."""
        self.abort(stream)
        if stream in self._open:
            self._open.discard(stream)
            self._open_requests -= len(stream.request_ids)

    def _cut_backlog(self, stream: RequestStream) -> None:
        """A stream whose client does not keep up: its requests stop, the output waiting
        for the client is dropped, and the client gets an error if it reads again (the
        app closes the connection of one that does not)."""
        backlog_mib = stream.backlog_bytes / 2**20
        self.release(stream)
        self.metrics.streams_stopped.labels("backlog").inc()
        log.warning(
            "stopped a stream whose client %s read too slowly: %.0f MiB of output waited",
            _address(stream.client),
            backlog_mib,
        )
        stream.cut(
            SlowReaderError(
                f"the client read this stream too slowly: more than "
                f"{self.stream_backlog_bytes / 2**20:.0f} MiB of its output waited to be "
                "sent, so the request was stopped; read a stream as it arrives"
            )
        )

    # ---- reports from the engine ----------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):  # (this thread may wait for the process to end)
                msg = Dead(f"the engine process exited ({self.exit_description()})")
            if isinstance(msg, StepReport):
                self.watch.heard(msg.sent_at)
                if not (msg.outputs or msg.errors or msg.stats or msg.step_s):
                    continue  # a heartbeat: nothing for the event loop
            try:
                self._loop.call_soon_threadsafe(self._dispatch, msg)
            except RuntimeError:  # the loop is closed: the server is gone
                return
            if isinstance(msg, (Dead, Fatal, Stopped)):
                return

    def _dispatch(self, msg) -> None:
        if isinstance(msg, StepReport):
            self._on_report(msg)
        elif isinstance(msg, Stopped):
            self.dead_reason = "stopped"
            self._fail_all(EngineDeadError("the server is shutting down"))
        elif self.shutting_down:  # it was told to stop; it did
            self.dead_reason = "stopped"
            self._fail_all(EngineDeadError("the server is shutting down"))
        else:
            self.dead_reason = "crashed" if isinstance(msg, Fatal) else "exited"
            payload = msg.traceback if isinstance(msg, Fatal) else msg.reason
            # The whole traceback goes to the server's log; clients get its last line (the
            # error itself, cut short), not the engine's internals.
            log.error("the engine process %s: %s", self.dead_reason, payload)
            cause = str(payload).strip().splitlines()[-1] if payload else self.dead_reason
            if len(cause) > _CAUSE_CHARS:
                cause = cause[: _CAUSE_CHARS - 3] + "..."
            self._fail_all(EngineDeadError(f"the engine process failed: {cause}"))
            if self.on_dead is not None:
                self.on_dead()

    def exit_description(self) -> str:
        """How the engine process ended: its exit code or the signal that killed it (waits
        up to a second for it to end: call it off the event loop)."""
        self._proc.join(1.0)  # its pipe closed: it is gone or going
        code = self._proc.exitcode
        if code is None:
            return "still running, its pipe closed"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def _on_report(self, report: StepReport) -> None:
        # (between whole stats, a report carries the queue lengths alone: `EngineLoop._send`;
        # updated in place on the event loop's thread, where /metrics reads it too)
        self.stats.update(report.stats)
        self.metrics.observe_steps(report.step_s, report.gap_s)
        now = time.monotonic()
        for fields in report.outputs:
            delta = OutputDelta(*fields)
            tracked = self._tracked.get(delta.request_id)
            if tracked is None:
                continue  # aborted while the step ran
            self._observe(tracked, delta, now, report.sent_at)
            stream = tracked.stream
            stream._put((tracked.index, delta))
            if delta.finished:
                self._finish(delta.request_id, tracked)
            # (a consumer not blocked on its client keeps up, or the server itself lags)
            if (
                stream.backlog_bytes > self.stream_backlog_bytes
                and stream.sending_since is not None
            ):
                self._cut_backlog(stream)
        for err in report.errors:
            tracked = self._tracked.get(err.request_id)
            if tracked is not None:  # (the engine refused it: its stream ends with the error)
                self.abort(tracked.stream, "error")
                tracked.stream._put(EngineRequestError(err))

    def _observe(self, tracked: _Tracked, delta: OutputDelta, now: float, sent: float) -> None:
        m = self.metrics
        n = len(delta.new_token_ids)
        if n:
            m.generation_tokens.inc(n)
            if tracked.last_token_at is None:
                m.ttft.observe(now - tracked.arrival)
                if tracked.stream.first_token_at is None:
                    tracked.stream.first_token_at = now
                if delta.added_at is not None:  # its parts, on the machine's one clock
                    m.ttft_parts.labels("to_engine").observe(delta.added_at - tracked.arrival)
                    m.ttft_parts.labels("in_engine").observe(sent - delta.added_at)
                    m.ttft_parts.labels("back").observe(now - sent)
            else:
                m.itl.observe((now - tracked.last_token_at) / n)
            tracked.last_token_at = now
        if delta.spec_stats is not None:
            m.observe_spec_stats(delta.spec_stats)
        if delta.finished:
            m.e2e.observe(now - tracked.arrival)
            m.finished.labels(delta.finish_reason or "abort").inc()

    def _finish(self, rid: str, tracked: _Tracked) -> None:
        del self._tracked[rid]
        stream = tracked.stream
        stream.unfinished.discard(rid)
        if stream.finished:
            stream._put(END)

    async def _watch_engine(self) -> None:
        """Every second: an engine silent past its bound fails the requests in flight (the
        process is stopped or hung; a busy one still beats) and new ones are refused
        until it answers again; /health says so meanwhile (`problem`). The engine is left
        to run: if it comes back, it serves again."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(_WATCH_S)
            now = time.monotonic()
            if now - last > 3 * _WATCH_S:  # this process stalled: let the reader catch up
                self.watch.resumed_at = now
            last = now
            if not self.watch.silent(now):
                if self._stalled:
                    log.warning("the engine process answers again")
                self._stalled = False
                continue
            if self._stalled or self.dead_reason is not None:
                continue
            self._stalled = True
            problem = self.watch.problem(now)
            log.error("%s; failing the requests in flight", problem)
            if self._tracked:
                self.abort_all(EngineStalledError(problem))

    def abort_all(self, exc: Exception) -> None:
        """Abort every request in flight; their streams end with `exc`."""
        self._fail_all(exc, abort_engine=True)

    def _fail_all(self, exc: Exception, abort_engine: bool = False) -> None:
        streams = {id(t.stream): t.stream for t in self._tracked.values()}
        for stream in streams.values():
            if abort_engine:
                self.abort(stream)
            stream.unfinished.clear()
            stream._put(exc)
        self._tracked.clear()


def _address(client: tuple | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "(unknown)"
