"""Tensor parallelism's processes: one per device. Rank 0 runs in the process that builds the
engine (the `LLM` user's, or the server's engine process); it spawns the other ranks of its
machine, each of which builds the same engine on its device and replays rank 0's step plans
until told to stop (engine/step_plan.py). Over several machines (`--nnodes`), each other
machine's `specserve serve --node-rank N` (or `generate`) runs its first rank the same way,
spawning that machine's others; every rank meets at `--dist-init-addr` (machine 0's
host:port), the standard torch.distributed TCP rendezvous. Every rank joins
torch.distributed: NCCL on GPUs (gloo on the CPU) for the forward's tensors, and a gloo group
for the plans.

A rank that dies or hangs makes the others fail rather than hang: rank 0 watches the
processes it spawned from the moment they start (the rendezvous too) and exits with a
message naming the rank and how it ended (a collective it waits in could not return
otherwise); a step whose collective fails first says the same (LLMEngine.step); a step that
has not ended after STEP_TIMEOUT_S (a rank stopped or stuck) ends rank 0's process. The
other ranks end when rank 0's connections close or, before the group forms or where a
collective would not notice (NCCL), when the process that spawned them is gone. They ignore
SIGINT (a Ctrl-C reaches the whole process group; rank 0 stops them) and are killed, not
asked, when rank 0 gives up on them. One group per process: a second is refused.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specserve.core.config import EngineConfig
from specserve.core.errors import ConfigError
from specserve.core.parallel import TensorParallel

log = logging.getLogger("specserve")

# How long a collective may wait for the other ranks (start-up included: a rank loading its
# shard of a large checkpoint from a slow disk keeps the others waiting in the first one).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
# Rank 0 idle (no plan sent) this share of COLLECTIVE_TIMEOUT sends the other ranks a plan
# of no step: they wait for plans inside a collective, which would time out after it and
# end an idle engine (a server with no traffic, an LLM between calls)
KEEP_ALIVE_SHARE = 1 / 6
GRACE_S = 5.0  # how long a failed rank's machine-mate may take to fail on its own
PARENT_POLL_S = 1.0  # how often a spawned rank checks that its spawning rank lives
# The longest a step may take under tensor parallelism before rank 0 takes a rank as hung
# (a step is milliseconds to seconds; first uses of a kernel shape compile for seconds)
STEP_TIMEOUT_S = 300.0


@dataclass
class ParallelContext:
    """This rank's place in the tensor-parallel group: the group for the forward's tensors
    (`tp`), the control group for plans, and on rank 0 the processes it spawned."""

    tp: TensorParallel
    control: object
    processes: list = field(default_factory=list)
    closing: threading.Event = field(default_factory=threading.Event)
    _step_since: float | None = None  # (monotonic) when the step under way began
    _step_watch: threading.Thread | None = None
    _closed: bool = False

    @property
    def rank(self) -> int:
        return self.tp.rank

    def step_began(self) -> None:
        """Rank 0 runs a step (or stops the ranks): one that has not ended after
        STEP_TIMEOUT_S means a rank hangs (stopped, stuck), whose collectives would keep
        this one waiting COLLECTIVE_TIMEOUT; the step watch then ends this process."""
        if self._step_watch is None:
            self._step_watch = threading.Thread(target=self._watch_steps, daemon=True)
            self._step_watch.start()
        self._step_since = time.monotonic()

    def step_ended(self) -> None:
        self._step_since = None

    def _watch_steps(self) -> None:
        while not self.closing.is_set():
            since = self._step_since
            if since is not None and time.monotonic() - since > STEP_TIMEOUT_S:
                lost = self.lost_rank(0.0)
                log.error(
                    "a tensor-parallel step has not ended in %.0f s: %s; stopping",
                    STEP_TIMEOUT_S,
                    lost or "a rank is stuck (stopped, or waiting in a collective)",
                )
                os._exit(1)
            self.closing.wait(min(1.0, STEP_TIMEOUT_S / 4))

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (e.g. KV pages: each device's free memory)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def abort(self) -> None:
        """Start-up failed on this rank, or a step was interrupted (the other ranks may wait
        in its collectives): stop the ranks it spawned without waiting for them (SIGKILL:
        they ignore SIGINT, and SIGTERM where the engine's process does), leave the groups."""
        self.closing.set()
        if not self._closed:
            for p in self.processes:
                p.kill()
        self.close()

    def close(self) -> None:
        """Wait for the spawned ranks (after the stop plan) and leave the groups, once (a
        later call, e.g. an engine's finalizer, must not leave another engine's group)."""
        self.closing.set()
        if self._closed:
            return
        self._closed = True
        for p in self.processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.processes = []
        if dist.is_initialized():
            dist.destroy_process_group()

    def lost_rank(self, timeout_s: float = 1.0) -> str | None:
        """A rank this one spawned that has exited, said with its cause (a collective that
        failed is often the first sign: its connection closed); None when all live."""
        deadline = time.monotonic() + timeout_s
        while True:
            for p in self.processes:
                if p.exitcode is not None:
                    return f"tensor-parallel rank {_rank_of(p)} (process {p.pid}) {_ended(p)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


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
    if dist.is_initialized():  # (a second group would fail after spawning its ranks)
        raise ConfigError(
            "this process holds a tensor-parallel engine already: close it (LLM.close()) "
            "before building another"
        )
    processes = []
    closing = threading.Event()
    if rank is None:
        check_shapes(config)  # (here, once, before any rank starts)
        rank = local[0]
        address = address or par.dist_init_addr or free_address()
        ctx = mp.get_context("spawn")
        for r in local[1:]:
            p = ctx.Process(
                target=follower_main,
                args=(
                    config,
                    r,
                    address,
                    logging.getLogger("specserve").getEffectiveLevel(),
                    COLLECTIVE_TIMEOUT.total_seconds(),
                ),
                name=f"specserve-tp{r}",
                daemon=True,
            )
            p.start()
            processes.append(p)
        if processes:  # (from now: one dying before the group forms would leave the
            # rendezvous waiting for it as long as COLLECTIVE_TIMEOUT)
            threading.Thread(target=_watch, args=(processes, closing), daemon=True).start()
    try:
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
    except BaseException:
        closing.set()
        for p in processes:
            p.kill()
        raise
    tp = TensorParallel(rank, size, dist.group.WORLD)
    context = ParallelContext(tp, control, processes, closing)
    if processes:  # at interpreter exit the spawned ranks (daemons) end: no failure then
        atexit.register(closing.set)
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
                    "tensor-parallel rank %s (process %s) %s; stopping",
                    _rank_of(p),
                    p.pid,
                    _ended(p),
                )
                os._exit(1)


def _rank_of(p) -> str:
    return p.name.removeprefix("specserve-tp")


def _ended(p) -> str:
    """How a process ended: its exit code, or the signal that killed it."""
    code = p.exitcode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        cause = " (out of memory?)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{cause}"
    return f"exited with code {code}"


def _watch_parent(parent) -> None:
    """A spawned rank: end when the rank that spawned it is gone (killed, crashed), which
    its collectives would notice only after COLLECTIVE_TIMEOUT where the group has not
    formed yet, or not at all (NCCL)."""
    while parent.is_alive():
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def follower_main(
    config: EngineConfig, rank: int, address: str, log_level: int, timeout_s: float
) -> None:
    """A rank > 0: build the engine on this rank's device, replay plans until the stop. It
    ignores SIGINT (a Ctrl-C reaches the whole process group; rank 0 stops the ranks) and
    ends when its spawning rank does. Its collectives wait as long as its spawning rank's
    (`timeout_s`: COLLECTIVE_TIMEOUT there)."""
    global COLLECTIVE_TIMEOUT
    COLLECTIVE_TIMEOUT = timedelta(seconds=timeout_s)
    logging.basicConfig(level=log_level, format=f"%(levelname)s [tp{rank}] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    from specserve.engine.engine import LLMEngine

    engine = LLMEngine(config, rank=rank, address=address)
    engine.follow()


def keep_alive(engine_ref, stop: threading.Event) -> None:
    """Rank 0's thread: while the engine (a weak reference: it may be dropped) lives, send
    the other ranks a plan of no step whenever none went out for KEEP_ALIVE_SHARE of
    COLLECTIVE_TIMEOUT (`LLMEngine.keep_alive`)."""
    every = COLLECTIVE_TIMEOUT.total_seconds() * KEEP_ALIVE_SHARE
    while not stop.wait(min(every / 4, 30.0)):
        engine = engine_ref()
        if engine is None:
            return
        engine.keep_alive(every)
        del engine
