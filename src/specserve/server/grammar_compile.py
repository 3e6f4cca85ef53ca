"""A request's grammar compiled for the HTTP process before the request is queued: a grammar
xgrammar refuses is a 400 before any stream starts, and the engine gets it compiled
(`Grammar.compiled`) and loads it instead of compiling it on its step loop.

xgrammar's compile time grows with the square of a schema's repeat counts: a 258-byte
schema with `"pattern": "[a-z]{0,9000}"` takes seconds, a nesting 400 levels deep tens of
seconds, and a compile cannot be stopped from inside. So grammars compile in worker
processes (pebble's ProcessPool, started with the first grammar a request brings), where a
compile that runs past COMPILE_TIMEOUT_S is ended by ending its process (the pool starts
another): it costs the server its time bound and no more, and never holds a worker, a core
or memory after it. Requests bringing a grammar whose compile is under way wait for that
compile; a request whose compile found no free worker within the bound is told to retry
(503), one whose grammar ran out the bound is refused (400), and a compile nobody waits for
any more is stopped.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections import OrderedDict
from concurrent import futures
from dataclasses import replace

from pebble import ProcessExpired, ProcessPool

from specserve.core.errors import InvalidRequestError
from specserve.core.sampling_params import Grammar
from specserve.runtime.grammar import GrammarCompiler, compile_in_worker, start_compile_worker
from specserve.server.errors import APIError, bad_request, from_invalid_request

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 10.0
COMPILE_WORKERS = 2
KEPT_BYTES = 64 << 20  # serialized grammars kept for the next request with the same one
RETRY_AFTER_S = 5


class _Job:
    """One grammar's compile: it waits for a free worker (`started` once it has one, then
    sent to the pool), and how many requests wait for it."""

    def __init__(self):
        self.started = False
        self.waiters = 0
        self.task: asyncio.Task | None = None  # (`GrammarChecker._run`)


class GrammarChecker:
    """Compiles grammars for requests (see the module) in `workers` processes, each given
    the tokenizer's tables of `grammars` (a GrammarCompiler) when the pool starts. `task`
    is what a worker runs for a grammar: (serialized, None) or (None, why it is refused)."""

    def __init__(
        self,
        grammars: GrammarCompiler,
        timeout_s: float = COMPILE_TIMEOUT_S,
        workers: int = COMPILE_WORKERS,
        task=compile_in_worker,
    ):
        self.grammars, self.timeout_s, self.workers, self.task = grammars, timeout_s, workers, task
        self._pool: ProcessPool | None = None
        self._closed = False
        self._starting = asyncio.Lock()
        self._slots = asyncio.Semaphore(workers)
        self._compiling: dict[tuple, _Job] = {}  # Grammar.key -> its compile under way
        self._kept: OrderedDict[tuple, str] = OrderedDict()  # Grammar.key -> serialized
        self._kept_bytes = 0

    async def compiled(self, grammar: Grammar) -> Grammar:
        """`grammar` with its compiled form (`Grammar.compiled`); an APIError when it does
        not compile (400), not within the time bound (400), or found no worker in time to
        compile (503)."""
        serialized = self._kept.get(grammar.key)
        if serialized is None:
            serialized = await self._compile(grammar)
            self._keep(grammar.key, serialized)
        else:
            self._kept.move_to_end(grammar.key)
        return replace(grammar, compiled=serialized)

    async def _compile(self, grammar: Grammar) -> str:
        job = self._compiling.get(grammar.key)
        if job is None:
            job = self._compiling[grammar.key] = _Job()
            job.task = asyncio.create_task(self._run(job, grammar))
        job.waiters += 1
        try:
            done, _ = await asyncio.wait([job.task], timeout=self.timeout_s)
            if not done:
                if not job.started:  # still waiting for a worker: every one was busy
                    raise _busy(grammar)
                # it started within the bound: it ends within its own (pebble ends it there)
                await asyncio.wait([job.task])
        finally:
            job.waiters -= 1
            if job.waiters == 0 and not job.task.done():  # nobody waits any more: a queued
                job.task.cancel()  # compile never starts, a running one ends with its worker
            if job.task.done() or job.waiters == 0:
                if self._compiling.get(grammar.key) is job:
                    del self._compiling[grammar.key]
        if job.task.cancelled():  # (the pool was stopped: the server is shutting down)
            raise _busy(grammar)
        error = job.task.exception()
        if isinstance(error, futures.TimeoutError):  # pebble's: it ran out the bound, ended
            what = "the grammar" if grammar.field == "grammar" else f"the {grammar.field} grammar"
            raise bad_request(
                f"{what} did not compile within {self.timeout_s:g} s; simplify it: large "
                "repeat counts (a pattern's {0,9000}) and deep nesting cost time that grows "
                "with their square",
                grammar.field,
            )
        if isinstance(error, ProcessExpired):  # (it ran out of memory, say)
            raise bad_request(
                f"compiling the grammar ended its compiler process (exit code {error.exitcode})"
                "; simplify it",
                grammar.field,
            )
        serialized, why = job.task.result()  # (any other error: the server's, a 500)
        if why is not None:
            raise from_invalid_request(InvalidRequestError(why, grammar.field))
        return serialized

    async def _run(self, job: _Job, grammar: Grammar) -> tuple[str | None, str | None]:
        """The compile: a worker slot first (pebble would send every task to its workers'
        pipe at once, and a task cancelled there still starts and costs its worker), then
        the pool, which ends it at the bound. Cancelled (nobody waits), it never starts or
        its worker is ended."""
        async with self._slots:
            pool = await self._started()
            job.started = True
            try:
                future = pool.schedule(self.task, (grammar,), timeout=self.timeout_s)
            except RuntimeError:  # the pool broke meanwhile (see `_started`): once more
                pool = await self._started()
                future = pool.schedule(self.task, (grammar,), timeout=self.timeout_s)
            return await asyncio.wrap_future(future)  # (cancelled: pebble's future too)

    async def _started(self) -> ProcessPool:
        """The worker pool, started with the first grammar (its workers import xgrammar and
        read the tokenizer's tables: a second or two, once)."""
        async with self._starting:
            broken = self._pool is not None and not self._pool.active and not self._closed
            if broken:
                # A worker that died while idle (killed, out of memory) puts pebble's pool in
                # its error state for good: every later compile failed (a 500) until the
                # server restarted. It is replaced.
                logger.warning("a grammar compile worker died; starting the workers again")
                old, self._pool = self._pool, None
                old.stop()
                await asyncio.to_thread(old.join, 10)
            if self._pool is None:
                info = await asyncio.to_thread(self.grammars.info_json)  # (~0.2 s a 49k vocab)
                self._pool = ProcessPool(
                    max_workers=self.workers,
                    initializer=start_compile_worker,
                    initargs=(info, self.grammars.vocab_size),
                    context=multiprocessing.get_context("spawn"),
                )
        return self._pool

    def close(self) -> None:
        """Stop the workers, compiles under way included (idempotent)."""
        self._closed = True
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=10)
            self._pool = None

    def _keep(self, key: tuple, serialized: str) -> None:
        if key in self._kept:
            return
        self._kept[key] = serialized
        self._kept_bytes += len(serialized)
        while self._kept_bytes > KEPT_BYTES and len(self._kept) > 1:
            self._kept_bytes -= len(self._kept.popitem(last=False)[1])


def _busy(grammar: Grammar) -> APIError:
    return APIError(
        503,
        "the server is busy compiling other requests' grammars; retry later",
        param=grammar.field,
        code="grammar_compiler_busy",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )
