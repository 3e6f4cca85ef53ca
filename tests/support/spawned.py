"""Run a function in a fresh (spawned) process and get its result, with a deadline: for
tensor-parallel engines, whose rank 0 spawns the other ranks and exits its process when one
of them dies (a test must see that exit, not be killed by it), and whose hang must fail a
test instead of the suite."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager


def _main(fn: Callable, args: tuple, out) -> None:
    try:
        out.put(("ok", fn(*args)))
    except BaseException as e:  # report it: the test names the failure
        out.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_spawned(fn: Callable, *args, timeout_s: float = 240.0):
    """fn(*args) in a spawned process: ("ok", result), ("error", text) when it raised, or
    ("exit", exit code) when the process ended without a result. A process still running
    after `timeout_s` is killed and the call raises TimeoutError. It and the ranks it spawns
    use one intra-op thread each, as tests/support/distributed.py's ranks do: with a thread
    per core each, two CPU ranks took twice as long on an idle 2-core machine."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_main, args=(fn, args, out))  # not a daemon: it spawns ranks
    with one_intra_op_thread():
        proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                return out.get(timeout=0.5)
            except queue.Empty:
                pass
            if not proc.is_alive():
                try:  # its result may have arrived just as it ended
                    return out.get(timeout=1.0)
                except queue.Empty:
                    return ("exit", proc.exitcode)
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"{fn.__name__} still ran after {timeout_s} s")
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


@contextmanager
def one_intra_op_thread():
    """OMP_NUM_THREADS=1 for the processes started inside (a spawned process reads it when
    it loads torch and hands it on to the ranks it spawns); the caller's is restored."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
