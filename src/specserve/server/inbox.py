"""The engine's inbox: a pipe that the HTTP process's event loop writes requests into itself.

Requests once went through a multiprocessing queue, whose feeder thread pickles and writes
them when it gets the GIL: after `submit` the event loop went on to start the response, and
a request waited ~0.5 ms in the HTTP process before it left (2-core CPU machine, issue 31).
Now the loop pickles a message and writes it to the pipe at once. The pipe is non-blocking:
what it cannot take now (the engine busy in a step, a long prompt) waits here, in order, and
the loop writes it as the pipe drains, so a write never blocks the loop. Frames are an
8-byte big-endian length and a pickle. The engine reads them with `Inbox`, which has a
queue's `get` (queue.Empty when nothing came in time; EOFError once the HTTP process has
gone).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import pickle
import queue
import struct
from multiprocessing.connection import Connection

_HEADER = struct.Struct("!Q")
# What the pipe holds before a write must wait for the event loop. A pipe's default 64 KiB
# takes ~20 requests of 512 tokens; a wave of arrivals (a closed-loop benchmark's first
# requests, a burst) waited in the loop, ~20 a step: at 256 arrivals on an H200 a request
# took 86-103 ms to reach the engine, against 21 ms through the queue before (whose feeder
# thread wrote while the engine drained). 1 MiB (Linux's default limit for a user) holds
# ~300 such requests.
PIPE_BYTES = 1 << 20


def _widen(fd: int) -> None:
    """Make the pipe hold PIPE_BYTES, or as much as the system allows (Linux only)."""
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        return
    try:
        with open("/proc/sys/fs/pipe-max-size") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        limit = PIPE_BYTES
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, min(PIPE_BYTES, limit))
    except OSError:
        pass  # (the default size: arrivals wait in the loop, as before)


def _frame(msg) -> bytes:
    buf = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(buf)) + buf


class InboxWriter:
    """The HTTP process's end; its writes never block. Attached to the running event loop,
    what the pipe cannot take at once waits here and goes out as the pipe drains; without a
    loop (before `attach`, after `detach`: start-up failures and the final exit, which send
    only Shutdown and then terminate an engine that does not stop) a message the pipe cannot
    take whole at once is dropped."""

    def __init__(self, conn: Connection):
        self._conn = conn  # (kept: it owns the descriptor)
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        _widen(self._fd)
        self._pending = bytearray()  # frames or their tails the pipe could not take yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self.broken = False  # the engine's end (or this one) is closed: messages are dropped

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Keep what the pipe cannot take at once and write it from `loop` (call from
        inside it)."""
        self._loop = loop
        if self._pending:
            loop.add_writer(self._fd, self._flush)

    def detach(self) -> None:
        """Stop writing from the loop (it is ending)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_writer(self._fd)
        self._loop = None

    def put(self, msg) -> None:
        if self.broken:
            return
        if self._pending:  # behind earlier frames
            if self._loop is not None:
                self._pending += _frame(msg)
            return
        frame = _frame(msg)
        try:
            n = os.write(self._fd, frame)
        except BlockingIOError:
            n = 0
        except OSError:
            self.broken = True
            return
        if n == 0 and self._loop is None:
            return  # (dropped whole: the stream stays framed)
        if n < len(frame):
            self._pending += memoryview(frame)[n:]
            if self._loop is not None:
                self._loop.add_writer(self._fd, self._flush)

    @property
    def pending_bytes(self) -> int:
        """Bytes put but not yet written to the pipe."""
        return len(self._pending)

    def close(self) -> None:
        """Close the pipe; later messages are dropped."""
        self.detach()
        self.broken = True
        self._conn.close()

    def _flush(self) -> None:
        try:
            n = os.write(self._fd, self._pending)
        except BlockingIOError:
            return
        except OSError:
            n, self.broken = len(self._pending), True
        del self._pending[:n]
        if not self._pending:
            self._loop.remove_writer(self._fd)


class Inbox:
    """The engine's end, with a queue's `get` / `get_nowait`."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._fd = conn.fileno()

    def get(self, timeout: float | None = None):
        """The next message; queue.Empty when none came within `timeout` seconds, EOFError
        when the writer has gone. A frame that has begun is read whole (its writer keeps
        writing it)."""
        if not self._conn.poll(timeout):
            raise queue.Empty
        (size,) = _HEADER.unpack(self._read(_HEADER.size))
        return pickle.loads(self._read(size))

    def get_nowait(self):
        return self.get(0)

    def _read(self, size: int) -> bytes:
        buf = bytearray()
        while len(buf) < size:
            chunk = os.read(self._fd, size - len(buf))
            if not chunk:
                raise EOFError("the HTTP process closed the engine's inbox")
            buf += chunk
        return bytes(buf)
