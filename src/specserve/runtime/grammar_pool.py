"""Structured output's masks filled in worker processes (`--grammar-workers`): each
constrained request's matcher lives in one worker, which follows its committed tokens, fills
its mask rows (drafts taken and rolled back, as `fill_masks` does in-process) straight into a
shared bitmask, and answers; the engine sends every worker its rows of a step, then waits for
them all.

Why processes: xgrammar holds the GIL while it fills, accepts and rolls back, so on the
engine's thread these ~15 us a row sit on the step's critical path between queueing the
forward and queueing the sampling (8B shape, 64 JSON-schema requests at K=3 on the H200:
~4 ms of a ~9.6 ms step, and the device waited for them), and a thread hides none of it.
Workers fill in parallel, each a share of the rows, and the engine's own part is to slice
each request's new tokens and drafts; the overlapped loop processes the step in flight
meanwhile (`send`, then `collect`: runtime/grammar.py start_masks).

The engine starts the workers with the first grammar a request brings and fills masks
itself until they are ready (`ready`: each has read the tokenizer's info).

Matchers are keyed by a handle the pool gives each request (`RemoteGrammar`); a request
goes to the worker with the fewest live ones. A compiled grammar travels to a worker once
(xgrammar's JSON serialization, ~1 ms to read back against ~5 ms to compile a small schema)
and stays there while a request uses it, and for CACHED_UNUSED more grammars after. A worker
that dies makes the next step that needs it fail with its name and exit code (its pipe
closes: never a hang)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import traceback
from collections import OrderedDict
from itertools import count
from multiprocessing.connection import Connection, Pipe
from pathlib import Path

import torch
import xgrammar as xgr

logger = logging.getLogger(__name__)

CACHED_UNUSED = 32  # compiled grammars a worker keeps once no request of its uses them
REPLY_TIMEOUT_S = 60.0  # a worker that answers no step for this long is taken as stuck


def default_workers(device: torch.device, ranks_here: int = 1) -> int:
    """Workers when `--grammar-workers` is not given: on a GPU a quarter of the host's cores
    shared by its tensor-parallel ranks (`ranks_here`), at most 4 a rank (the H200's host: 4
    of 16), none where that leaves fewer than 2 (one worker does the engine's fill plus a
    round trip); none on a CPU, where the model's own work holds the cores."""
    if device.type == "cpu":
        return 0
    workers = min(4, (os.cpu_count() or 1) // (4 * ranks_here))
    return workers if workers >= 2 else 0


def unseen_tokens(num_taken: int, output: list[int], unprocessed) -> list[int]:
    """A request's committed tokens past the first `num_taken`, `output`'s then
    `unprocessed`'s (a step's not processed yet), without joining the two lists: the new
    tokens cost a step, not the output's length."""
    done = len(output)
    new = output[num_taken:] if num_taken < done else []
    return new + list(unprocessed[max(0, num_taken - done) :])


def take_tokens(matcher: xgr.GrammarMatcher, tokens: list[int]) -> None:
    """Advance a matcher through committed tokens (drawn under its masks, so legal; past
    the grammar's end, under ignore_eos, there is nothing to take)."""
    for token in tokens:
        if not matcher.is_terminated():
            matcher.accept_token(token)


class RemoteGrammar:
    """One request's matcher in a worker: which worker, its handle there, its grammar's key,
    and how many of the request's output tokens the worker has been sent."""

    __slots__ = ("pool", "worker", "handle", "key", "num_taken", "grammar")

    def __init__(self, pool: GrammarPool, worker: int, handle: int, key):
        self.pool, self.worker, self.handle, self.key = pool, worker, handle, key
        self.num_taken = 0
        self.grammar: str | None = None  # the compiled grammar's JSON, until sent

    def new_tokens(self, output: list[int], unprocessed) -> list[int]:
        """The committed tokens the worker has not been sent."""
        new = unseen_tokens(self.num_taken, output, unprocessed)
        self.num_taken = len(output) + len(unprocessed)
        return new

    def release(self) -> None:
        """The request ended: its matcher goes at the worker's next message."""
        self.pool.release(self)


class _Worker:
    """The engine's side of one worker: its process and pipe, its live requests, and the
    grammars it holds (key -> live requests using it; unused ones in LRU order)."""

    def __init__(self, index: int, info_json: str):
        self.name = f"specserve-grammar-{index}"
        self.index = index
        self.conn, child = Pipe()
        # A fresh interpreter running this module (not multiprocessing's spawn, which
        # would import the user's main script again in it), on the pipe's other end.
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specserve.runtime.grammar_pool", str(child.fileno())],
            pass_fds=[child.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        child.close()  # so that recv sees EOF if the worker dies
        self.conn.send(info_json)
        self.ready = False  # it said so (once it has read the tokenizer's info)
        self.live = 0
        self.grammars: dict = {}  # key -> live requests
        self.unused: OrderedDict = OrderedDict()  # keys no live request uses, oldest first
        self.dropped_handles: list[int] = []
        self.dropped_grammars: list = []

    def hold(self, key) -> bool:
        """A request of grammar `key` comes here; True when the worker lacks the grammar."""
        self.live += 1
        if key in self.grammars:
            self.grammars[key] += 1
            return False
        self.grammars[key] = 1
        if key in self.unused:  # held, unused until now
            del self.unused[key]
            return False
        return True

    def let_go(self, handle: int, key) -> None:
        self.live -= 1
        self.dropped_handles.append(handle)
        users = self.grammars[key] - 1
        if users:
            self.grammars[key] = users
            return
        del self.grammars[key]
        self.unused[key] = None
        while len(self.unused) > CACHED_UNUSED:
            self.dropped_grammars.append(self.unused.popitem(last=False)[0])

    def failed(self) -> RuntimeError:
        try:
            code = self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        return RuntimeError(
            f"grammar worker {self.name} died (exit code {code}); structured output cannot continue"
        )


class GrammarPool:
    """Worker processes holding constrained requests' matchers (module docstring)."""

    def __init__(self, info_json: str, workers: int):
        self.workers = [_Worker(i, info_json) for i in range(workers)]
        logger.info("structured output: %d grammar worker processes", workers)
        self._handles = count()
        self._serialized: OrderedDict = OrderedDict()  # key -> compiled grammar's JSON
        self._mapped: dict[int, int] = {}  # slot -> serial of the buffer every worker maps
        self._ticket: tuple | None = None  # the step sent whose replies are not read yet
        self._ready = False
        self.closed = False

    def remote(self, compiled: xgr.CompiledGrammar, key) -> RemoteGrammar:
        """A new request's matcher, on the worker with the fewest live ones (its grammar goes
        with its first rows where the worker lacks it)."""
        worker = min(self.workers, key=lambda w: w.live)
        state = RemoteGrammar(self, worker.index, next(self._handles), key)
        if worker.hold(key):
            if key not in self._serialized:
                self._serialized[key] = compiled.serialize_json()
                while len(self._serialized) > 4 * CACHED_UNUSED:
                    self._serialized.popitem(last=False)
            state.grammar = self._serialized[key]
        return state

    @property
    def ready(self) -> bool:
        """Whether every worker has started (has read the tokenizer's info); never waits.
        A worker that died starting fails here, by name."""
        if self._ready:
            return True
        for worker in self.workers:
            if not worker.ready:
                try:
                    if not worker.conn.poll(0):
                        return False
                    worker.conn.recv()
                except (EOFError, ConnectionResetError, OSError):
                    raise worker.failed() from None
                worker.ready = True
        self._ready = True
        return True

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until `ready` (tests, and callers that want the workers from the start)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            if time.monotonic() > deadline:
                raise RuntimeError(f"grammar workers did not start in {timeout_s:.0f} s")
            time.sleep(0.01)

    def release(self, state: RemoteGrammar) -> None:
        if not self.closed:
            self.workers[state.worker].let_go(state.handle, state.key)

    def send(self, bitmask: torch.Tensor, buffer: tuple[int, int, str], jobs: list) -> tuple:
        """Send every worker its part of filling `bitmask`'s rows (the first rows of the
        shared buffer `buffer`: its slot, serial number and file, `MaskBuffer`) of each job:
        (state, new tokens, first row, drafts); `collect` waits for them (the ticket it
        takes). A new buffer in a slot goes to every worker."""
        if not self._ready:  # (the engine sends only once ready: `start_masks`)
            self.wait_ready()
        if self._ticket is not None:  # (never left: a reply unread would answer this step)
            self.collect(self._ticket)
        slot, serial, path = buffer
        new = self._mapped.get(slot) != serial
        by_worker: list[list] = [[] for _ in self.workers]
        for state, tokens, first, drafts in jobs:
            grammar, state.grammar = state.grammar, None
            job = (state.handle, state.key, grammar, tokens, first, drafts)
            by_worker[state.worker].append(job)
        waiting = []
        for worker, work in zip(self.workers, by_worker):
            if not work and not new:
                continue
            message = (
                slot,
                path if new else None,
                bitmask.shape[1],
                worker.dropped_handles,
                worker.dropped_grammars,
                work,
            )
            worker.dropped_handles, worker.dropped_grammars = [], []
            try:
                worker.conn.send(message)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                raise worker.failed() from None
            waiting.append(worker)
        self._ticket = (waiting, (slot, serial, path) if new else None)
        return self._ticket

    def collect(self, ticket: tuple) -> None:
        """Wait for the workers `send` sent to; a new buffer's file is then removed (each
        worker keeps its mapping)."""
        waiting, new = ticket
        self._ticket = None
        failure = None
        for worker in waiting:  # (every reply read, so that none is left for a later step)
            try:
                if not worker.conn.poll(REPLY_TIMEOUT_S):
                    raise RuntimeError(
                        f"grammar worker {worker.name} did not answer in {REPLY_TIMEOUT_S:.0f} s"
                    )
                reply = worker.conn.recv()
            except (EOFError, ConnectionResetError, OSError):
                raise worker.failed() from None
            if reply is not None and failure is None:
                failure = RuntimeError(f"grammar worker {worker.name} failed:\n{reply}")
        if failure is not None:
            raise failure
        if new is not None:
            slot, serial, path = new
            self._mapped[slot] = serial
            Path(path).unlink(missing_ok=True)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for worker in self.workers:
            try:
                worker.conn.send(None)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                pass
        deadline = time.monotonic() + 5.0
        for worker in self.workers:
            try:
                worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.process.kill()
            worker.conn.close()


def _serve(conn: Connection) -> None:
    """A worker's loop: the tokenizer's info first, then one message a step (module
    docstring), None to stop."""
    from specserve.runtime.grammar import BatchFill, fill_masks

    try:
        info = xgr.TokenizerInfo.deserialize_json(conn.recv())
        conn.send(None)  # ready
    except (EOFError, ConnectionResetError, BrokenPipeError):
        return
    grammars: dict = {}
    matchers: dict[int, xgr.GrammarMatcher] = {}
    buffers: dict[int, torch.Tensor] = {}  # slot -> the engine's shared bitmask, flat
    batch_fill = BatchFill(1)
    while True:
        try:
            message = conn.recv()
        except (EOFError, ConnectionResetError):  # the engine's process is gone
            return
        if message is None:
            return
        try:
            slot, path, words, dropped, dropped_grammars, work = message
            for handle in dropped:
                matchers.pop(handle, None)
            for key in dropped_grammars:
                grammars.pop(key, None)
            if path is not None:  # a new buffer in this slot (the engine keeps two)
                size = os.path.getsize(path) // 4
                buffers[slot] = torch.from_file(path, shared=True, size=size, dtype=torch.int32)
            spans = []
            for handle, key, grammar, tokens, first, drafts in work:
                if grammar is not None:
                    grammars[key] = xgr.CompiledGrammar.deserialize_json(grammar, info)
                matcher = matchers.get(handle)
                if matcher is None:
                    matcher = matchers[handle] = xgr.GrammarMatcher(grammars[key])
                take_tokens(matcher, tokens)
                spans.append((matcher, first, drafts))
            if spans:
                fill_masks(buffers[slot].view(-1, words), spans, batch_fill)
            conn.send(None)
        except Exception:  # reported to the engine, which fails the step with it
            conn.send(traceback.format_exc())


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
