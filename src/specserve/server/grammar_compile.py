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


class GrammarChecker:
    """Compiles grammars for requests (see the module). Each compile runs on a daemon
    thread that waits for one of `threads` slots: a compile cannot be stopped, and one
    running out in the background must not hold up the server's exit."""

    def __init__(
        self,
        grammars: GrammarCompiler,
        timeout_s: float = COMPILE_TIMEOUT_S,
        threads: int = COMPILE_THREADS,
    ):
        self.grammars = grammars
        self.timeout_s = timeout_s
        self._slots = threading.Semaphore(threads)
        self._kept: OrderedDict[tuple, str] = OrderedDict()  # Grammar.key -> serialized
        self._kept_bytes = 0

    async def compiled(self, grammar: Grammar) -> Grammar:
        """`grammar` with its compiled form (`Grammar.compiled`); an APIError when it does
        not compile (400), not in time (400), or found no thread in time (503)."""
        serialized = self._kept.get(grammar.key)
        if serialized is None:
            serialized = await self._compile(grammar)
            self._keep(grammar.key, serialized)
        else:
            self._kept.move_to_end(grammar.key)
        return replace(grammar, compiled=serialized)

    async def _compile(self, grammar: Grammar) -> str:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        started, dropped = threading.Event(), threading.Event()

        def settle(result, error) -> None:
            if not done.done():
                if error is None:
                    done.set_result(result)
                else:
                    done.set_exception(error)

        def run() -> None:
            with self._slots:
                if dropped.is_set():  # (timed out waiting for a slot: nobody waits for it)
                    return
                started.set()
                result, error = None, None
                try:
                    result = self.grammars.serialize(grammar)
                except Exception as e:
                    error = e
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the loop is gone (the server stopped meanwhile)
                pass

        threading.Thread(target=run, name="grammar-compile", daemon=True).start()
        try:
            return await asyncio.wait_for(done, self.timeout_s)
        except InvalidRequestError as e:
            raise from_invalid_request(e) from e
        except asyncio.TimeoutError:
            dropped.set()
            if not started.is_set():
                raise APIError(
                    503,
                    "the server is busy compiling other requests' grammars; retry later",
                    param=grammar.field,
                    code="grammar_compiler_busy",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                ) from None
            raise bad_request(
                f"the {grammar.field} grammar did not compile within {self.timeout_s:g} s; "
                "simplify it: large repeat counts (a pattern's {0,9000}) and deep nesting "
                "cost time that grows with their square",
                grammar.field,
            ) from None

    def _keep(self, key: tuple, serialized: str) -> None:
        if key in self._kept:
            return
        self._kept[key] = serialized
        self._kept_bytes += len(serialized)
        while self._kept_bytes > KEPT_BYTES and len(self._kept) > 1:
            self._kept_bytes -= len(self._kept.popitem(last=False)[1])
