"""The engine's inbox (server/inbox.py): the event loop's writes reach the pipe at once and
never block it; what the pipe cannot take goes out in order as it drains."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import threading

import pytest

from specserve.core.sampling_params import SamplingParams
from specserve.server.inbox import Inbox, InboxWriter
from specserve.server.messages import AbortRequests, AddRequest, AddRequests, Shutdown


def _pipe() -> tuple[Inbox, InboxWriter]:
    reader, writer = mp.Pipe(duplex=False)
    return Inbox(reader), InboxWriter(writer)


def test_a_put_is_in_the_pipe_when_it_returns():
    # (the multiprocessing queue's feeder thread wrote it only once the loop let go of the GIL)
    inbox, writer = _pipe()
    msg = AddRequests([AddRequest("a", list(range(2112)), SamplingParams(max_tokens=4))])

    async def main() -> object:
        writer.attach(asyncio.get_running_loop())
        writer.put(msg)
        return inbox.get_nowait()  # nothing awaited: no other thread or callback has run

    got = asyncio.run(main())
    assert got == msg
    with pytest.raises(queue.Empty):
        inbox.get(timeout=0.01)


def test_what_the_pipe_cannot_take_waits_in_order_without_blocking_the_loop():
    inbox, writer = _pipe()
    big = AddRequests([AddRequest("big", list(range(500_000)), SamplingParams())])
    received: list = []

    async def main() -> int:
        loop = asyncio.get_running_loop()
        writer.attach(loop)
        writer.put(big)  # megabytes: far more than a pipe holds
        writer.put(AbortRequests(["big"]))
        waiting = writer.pending_bytes
        reader = threading.Thread(target=lambda: received.extend(inbox.get() for _ in range(2)))
        reader.start()
        while writer.pending_bytes:  # written by the loop as the reader drains the pipe
            await asyncio.sleep(0.001)
        await asyncio.to_thread(reader.join, 30)
        writer.detach()
        return waiting

    assert asyncio.run(main()) > 0
    assert received == [big, AbortRequests(["big"])]
    writer.put(Shutdown())  # without a loop (the server's last words)
    assert inbox.get(timeout=5) == Shutdown()


def test_a_wave_of_arrivals_goes_into_the_pipe_at_once():
    # 256 requests of 512 tokens arriving together: none waits for the loop to write it
    # (with a pipe's default 64 KiB, all but ~20 did, and the engine took ~20 a step)
    if not hasattr(pytest.importorskip("fcntl"), "F_SETPIPE_SZ"):
        pytest.skip("pipe sizes are set on Linux only")
    inbox, writer = _pipe()
    wave = [
        AddRequests([AddRequest(f"r{i}", list(range(100_000, 100_512)), SamplingParams())])
        for i in range(256)
    ]

    async def main() -> int:
        writer.attach(asyncio.get_running_loop())
        for msg in wave:
            writer.put(msg)
        return writer.pending_bytes

    assert asyncio.run(main()) == 0
    assert [inbox.get_nowait() for _ in wave] == wave


def test_the_engine_sees_eof_once_the_writer_is_gone():
    inbox, writer = _pipe()
    writer.put(Shutdown())
    writer.close()
    writer.put(AbortRequests(["late"]))  # dropped, not written to a closed descriptor
    assert inbox.get(timeout=5) == Shutdown()
    with pytest.raises(EOFError):
        inbox.get(timeout=5)
