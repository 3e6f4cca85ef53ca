"""A request's grammar compiled in the HTTP process before the request is queued: a grammar
xgrammar refuses is a 400 before any stream starts, and the engine gets it compiled
(`Grammar.compiled`) and loads it instead of compiling it on its step loop.

xgrammar's compile time grows with the square of a schema's repeat counts: a 258-byte
schema with `"pattern": "[a-z]{0,9000}"` takes seconds, a nesting 400 levels deep tens of
seconds. So grammars compile on threads of their own (xgrammar releases the GIL: the event
loop goes on), not the pool that encodes prompts, and a request whose grammar has not
compiled within COMPILE_TIMEOUT_S is refused (400) while its compile runs out in the
background (xgrammar keeps what it compiled: the same grammar again is at once); one that
waited that long for a thread because others' compiles held them all is told to retry
(503) and its compile never starts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from dataclasses import replace

from specserve.core.errors import InvalidRequestError
from specserve.core.sampling_params import Grammar
from specserve.runtime.grammar import GrammarCompiler
from specserve.server.errors import APIError, bad_request, from_invalid_request

COMPILE_TIMEOUT_S = 10.0
COMPILE_THREADS = 2
KEPT_BYTES = 64 << 20  # serialized grammars kept for the next request with the same one
RETRY_AFTER_S = 5


class _Compile:
    """One grammar's compile on its own daemon thread, which waits for a slot first: its
    state moves waiting -> running -> done, or waiting -> dropped (nobody waits for it any
    more: it never starts), under one lock."""

    def __init__(self, checker: GrammarChecker, grammar: Grammar):
        self.loop = asyncio.get_running_loop()
        self.done = self.loop.create_future()
        self.state, self.started_at = "waiting", 0.0
        self.waiters = 0
        self._lock = threading.Lock()
        self._checker, self._grammar = checker, grammar
        threading.Thread(target=self._run, name="grammar-compile", daemon=True).start()

    def _run(self) -> None:
        slots = self._checker._slots
        if not slots.acquire(timeout=self._checker.timeout_s):
            return  # (its waiters have given up by now)
        try:
            with self._lock:
                if self.state == "dropped":
                    return
                self.state, self.started_at = "running", time.monotonic()
            result, error = None, None
            try:
                result = self._checker.grammars.serialize(self._grammar)
            except Exception as e:
                error = e
        finally:
            slots.release()
        try:
            self.loop.call_soon_threadsafe(self._settle, result, error)
        except RuntimeError:  # the loop is gone (the server stopped meanwhile)
            pass

    def _settle(self, result, error) -> None:
        self.state = "done"
        if not self.done.done():
            if error is None:
                self.done.set_result(result)
            else:
                self.done.set_exception(error)

    def drop(self) -> float | None:
        """Nobody waits any more: a compile not started never starts. Returns how long it
        has run (None: it had not started)."""
        with self._lock:
            if self.state == "waiting":
                self.state = "dropped"
                return None
            return time.monotonic() - self.started_at


class GrammarChecker:
    """Compiles grammars for requests (see the module). Each compile runs on a daemon
    thread that waits for one of `threads` slots (a compile cannot be stopped, and one
    running out in the background must not hold up the server's exit); requests bringing
    a grammar being compiled wait for that compile."""

    def __init__(
        self,
        grammars: GrammarCompiler,
        timeout_s: float = COMPILE_TIMEOUT_S,
        threads: int = COMPILE_THREADS,
    ):
        self.grammars = grammars
        self.timeout_s = timeout_s
        self._slots = threading.Semaphore(threads)
        self._compiling: dict[tuple, _Compile] = {}  # Grammar.key -> its compile under way
        self._kept: OrderedDict[tuple, str] = OrderedDict()  # Grammar.key -> serialized
        self._kept_bytes = 0

    async def compiled(self, grammar: Grammar) -> Grammar:
        """`grammar` with its compiled form (`Grammar.compiled`); an APIError when it does
        not compile (400), not within the time bound (400), or found no thread in time to
        compile within it (503)."""
        serialized = self._kept.get(grammar.key)
        if serialized is None:
            serialized = await self._compile(grammar)
            self._keep(grammar.key, serialized)
        else:
            self._kept.move_to_end(grammar.key)
        return replace(grammar, compiled=serialized)

    async def _compile(self, grammar: Grammar) -> str:
        job = self._compiling.get(grammar.key)
        if job is None or job.state == "dropped":
            job = self._compiling[grammar.key] = _Compile(self, grammar)
        job.waiters += 1
        try:
            return await asyncio.wait_for(asyncio.shield(job.done), self.timeout_s)
        except InvalidRequestError as e:
            raise from_invalid_request(e) from e
        except asyncio.TimeoutError:
            ran = job.drop() if job.waiters == 1 else job_time(job)
            if ran is None or ran < self.timeout_s / 2:  # (it waited for a thread)
                raise APIError(
                    503,
                    "the server is busy compiling other requests' grammars; retry later",
                    param=grammar.field,
                    code="grammar_compiler_busy",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                ) from None
            what = "the grammar" if grammar.field == "grammar" else f"the {grammar.field} grammar"
            raise bad_request(
                f"{what} did not compile within {self.timeout_s:g} s; simplify it: large "
                "repeat counts (a pattern's {0,9000}) and deep nesting cost time that grows "
                "with their square",
                grammar.field,
            ) from None
        except asyncio.CancelledError:  # (the client went away)
            if job.waiters == 1:
                job.drop()
            raise
        finally:
            job.waiters -= 1
            if job.state in ("done", "dropped") and self._compiling.get(grammar.key) is job:
                del self._compiling[grammar.key]

    def _keep(self, key: tuple, serialized: str) -> None:
        if key in self._kept:
            return
        self._kept[key] = serialized
        self._kept_bytes += len(serialized)
        while self._kept_bytes > KEPT_BYTES and len(self._kept) > 1:
            self._kept_bytes -= len(self._kept.popitem(last=False)[1])


def job_time(job: _Compile) -> float | None:
    """How long a compile others still wait for has run (None: not started)."""
    return None if job.state == "waiting" else time.monotonic() - job.started_at
