"""Tensor parallelism's processes: one per device. Rank 0 runs in the process that builds the
engine (the `LLM` user's, or the server's engine process); it spawns the other ranks of its
machine, each of which builds the same engine on its device and replays rank 0's step plans
until told to stop (engine/step_plan.py). Over several machines (`--nnodes`), each other
machine's `specserve serve --node-rank N` (or `generate`) runs its first rank the same way,
spawning that machine's others; every rank meets at `--dist-init-addr` (machine 0's
host:port), the standard torch.distributed TCP rendezvous. Every rank joins
torch.distributed: NCCL on GPUs (gloo on the CPU) for the forward's tensors, and a gloo group
for the plans.

A rank that dies makes the others fail rather than hang: rank 0 watches the processes it
spawned and exits with their exit code and a message naming the rank (a collective it waits
in could not return otherwise); the other ranks' collectives fail when rank 0's connections
close (they also run as daemons of rank 0's process).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specserve.core.config import EngineConfig
from specserve.core.parallel import TensorParallel

log = logging.getLogger("specserve")

# How long a collective may wait for the other ranks (start-up included: a rank loading its
# shard of a large checkpoint from a slow disk keeps the others waiting in the first one).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
GRACE_S = 5.0  # how long a failed rank's machine-mate may take to fail on its own


@dataclass
class ParallelContext:
    """This rank's place in the tensor-parallel group: the group for the forward's tensors
    (`tp`), the control group for plans, and on rank 0 the processes it spawned."""

    tp: TensorParallel
    control: object
    processes: list = field(default_factory=list)
    closing: threading.Event = field(default_factory=threading.Event)

    @property
    def rank(self) -> int:
        return self.tp.rank

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (e.g. KV pages: each device's free memory)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def abort(self) -> None:
        """Start-up failed on this rank: stop the ranks it spawned, without waiting for them."""
        self.closing.set()
        for p in self.processes:
            p.terminate()
        self.close()

    def close(self) -> None:
        """Wait for the spawned ranks (after the stop plan) and leave the groups."""
        self.closing.set()
        for p in self.processes:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        self.processes = []
        if dist.is_initialized():
            dist.destroy_process_group()


def free_address() -> str:
    """host:port of a free TCP port on this machine (the rendezvous of a one-node group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def node_ranks(config: EngineConfig) -> range:
    """The ranks this machine runs (`--node-rank` of `--nnodes`, each running as many)."""
    par = config.parallel
    per_node = par.tensor_parallel_size // par.nnodes
    return range(par.node_rank * per_node, (par.node_rank + 1) * per_node)


def check_shapes(config: EngineConfig) -> None:
    """ConfigError when the model (or a sharded EAGLE-3 head) cannot be split over the
    group's ranks; else every rank would find it and fail with its own traceback."""
    from specserve.layers.parallel import check_shards
    from specserve.model.loader import load_config, resolve_model

    size = config.parallel.tensor_parallel_size
    check_shards(
        load_config(resolve_model(config.load.model, config.load.format)), size, "the model"
    )
    spec = config.speculative
    if spec.algorithm == "eagle3" and spec.head_parallel == "sharded" and spec.draft_model_path:
        from specserve.model.eagle3_config import Eagle3Config

        check_shards(Eagle3Config.load(spec.draft_model_path).layer, size, "the EAGLE-3 head")


def start(config: EngineConfig, rank: int | None, address: str | None) -> ParallelContext:
    """Join the tensor-parallel group of `config` as `rank` (None: this machine's first, which
    spawns the machine's other ranks first). The group meets at `--dist-init-addr` (given
    with several machines), else at a free port of this one."""
    par = config.parallel
    size, local = par.tensor_parallel_size, node_ranks(config)
    processes = []
    if rank is None:
        check_shapes(config)  # (here, once, before any rank starts)
        rank = local[0]
        address = address or par.dist_init_addr or free_address()
        ctx = mp.get_context("spawn")
        for r in local[1:]:
            p = ctx.Process(
                target=follower_main,
                args=(config, r, address, logging.getLogger("specserve").getEffectiveLevel()),
                name=f"specserve-tp{r}",
                daemon=True,
            )
            p.start()
            processes.append(p)
    device = config.load.torch_device()
    if device.type == "cuda":
        torch.cuda.set_device(rank - local[0])  # this machine's devices 0, 1, ...
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    context = ParallelContext(TensorParallel(rank, size, dist.group.WORLD), control, processes)
    if processes:
        threading.Thread(target=_watch, args=(processes, context.closing), daemon=True).start()
        # at interpreter exit the spawned ranks (daemons) are terminated: no failure then
        atexit.register(context.closing.set)
    return context


def _watch(processes: list, closing: threading.Event) -> None:
    """A machine's first rank: a rank it spawned that exits before it is told to stop ends
    this process too,
    with a message naming it, instead of leaving a collective waiting forever."""
    from multiprocessing.connection import wait

    sentinels = {p.sentinel: p for p in processes}
    while sentinels:
        for s in wait(list(sentinels)):
            p = sentinels.pop(s)
            p.join(timeout=5)  # (reaped: its exit code is known)
            # A failure every rank meets (a shape the ranks cannot split, a bad checkpoint)
            # reaches this rank too within moments: then its own error stands, not this exit.
            if p.exitcode != 0 and not closing.wait(GRACE_S):
                log.error(
                    "tensor-parallel rank %s (process %s) exited with code %s; stopping",
                    p.name.removeprefix("specserve-tp"),
                    p.pid,
                    p.exitcode,
                )
                os._exit(1)


def follower_main(config: EngineConfig, rank: int, address: str, log_level: int) -> None:
    """A rank > 0: build the engine on this rank's device, replay plans until the stop."""
    logging.basicConfig(level=log_level, format=f"%(levelname)s [tp{rank}] %(message)s")
    from specserve.engine.engine import LLMEngine

    engine = LLMEngine(config, rank=rank, address=address)
    engine.follow()
