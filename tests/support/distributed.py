"""Run a function on N ranks of a gloo group on the CPU, one spawned process per rank, and
collect what each rank returns.

`run_ranks(fn, world_size, *args)` starts the processes (spawn start method, a free TCP
port from the OS), each calls `fn(*args)` inside an initialized gloo process group and
sends back its result with every tensor as a numpy array. A rank that raises fails the test
with its traceback; ranks that have not answered after `timeout_s` (a hung collective) are
terminated and the test fails, rather than hanging the run. `tensor_parallel_groups` gives
a rank its group of each size, so one spawn serves tests at several sizes.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch

TIMEOUT_S = 240.0  # for the whole run; a collective gives up after half of it


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def to_host(value):
    """`value` with every tensor replaced by a numpy copy (nothing shared between
    processes)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone().numpy()
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value)
    return value


def _rank_main(fn, rank, world_size, port, args, results, timeout_s):
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s / 2),
        )
        results.put((rank, True, to_host(fn(*args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = TIMEOUT_S) -> list:
    """fn(*args) on ranks 0..world_size-1 of a gloo group (fn importable by name: spawned
    processes import it); each rank's result, in rank order."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    env = {"OMP_NUM_THREADS": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, port, args, results, timeout_s),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                _check_alive(procs, out, results, deadline, timeout_s)
                continue
            if not ok:
                pytest.fail(f"rank {rank} of {world_size} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [out[r] for r in range(world_size)]


def _check_alive(procs, out, results, deadline, timeout_s) -> None:
    """Fail when a rank died without a result (e.g. at import), or past the deadline."""
    for rank, p in enumerate(procs):
        if rank not in out and p.exitcode is not None:
            try:  # its result may still be in the pipe
                results_rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                pytest.fail(f"rank {rank} exited with status {p.exitcode} and no result")
            if not ok:
                pytest.fail(f"rank {results_rank} failed:\n{value}")
            out[results_rank] = value
            return
    if time.monotonic() > deadline:
        late = sorted(set(range(len(procs))) - set(out))
        pytest.fail(f"ranks {late} did not finish in {timeout_s:.0f} s (a hung collective?)")


def tensor_parallel_groups(sizes):
    """This rank's TensorParallel in a group of ranks 0..size-1 for each size (None where
    the rank is outside it); every rank must call it with the same sizes."""
    import torch.distributed as dist

    from specserve.core.parallel import SINGLE_RANK, TensorParallel

    rank = dist.get_rank()
    groups = {}
    for size in sizes:
        if size == 1:
            groups[size] = SINGLE_RANK if rank == 0 else None
            continue
        group = dist.new_group(list(range(size)))  # a collective call: every rank makes it
        groups[size] = TensorParallel.of(group) if rank < size else None
    return groups
