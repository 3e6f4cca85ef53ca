"""Tensor parallelism's processes when something goes wrong (CPU, gloo, two ranks): a rank
that dies before the group forms, a rank 0 killed, a rank that hangs, a step interrupted on
rank 0, a second group in one process. Each ends in a bounded time with a message naming
the cause, and leaves no process behind; none waits out the collectives' 30 minutes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from specserve import SamplingParams
from tests.support.spawned import one_intra_op_thread, run_spawned
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tp_fail"), "llama", num_layers=4))


def _gone(pid: int, within_s: float) -> bool:
    """Whether process `pid` has ended (or is a zombie) within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _die_at_once(*args) -> None:
    os._exit(3)


def _follower_dies_before_the_group_forms(target: str) -> None:
    from specserve import LLM
    from specserve.engine import tensor_parallel

    tensor_parallel.follower_main = _die_at_once  # (what the spawned rank runs)
    LLM(target, tensor_parallel_size=2, speculative_algorithm="none")


def test_a_rank_that_dies_before_the_group_forms_ends_rank_0(target):
    # rank 0 waits in the rendezvous for it: its watch ends the process (not 30 minutes)
    status, detail = run_spawned(_follower_dies_before_the_group_forms, target, timeout_s=90)
    assert (status, detail) == ("exit", 1)


def _stall_in_the_rendezvous(pid_file: str) -> None:
    """Rank 0 spawns its rank, notes its pid, then never joins the group."""
    from specserve import LLM
    from specserve.engine import tensor_parallel

    def stall(*args, **kwargs):
        (rank,) = [c for c in psutil.Process().children() if "spawn_main" in " ".join(c.cmdline())]
        Path(pid_file).write_text(str(rank.pid))
        time.sleep(600)

    tensor_parallel.dist.init_process_group = stall
    LLM(pid_file + ".model", tensor_parallel_size=2, speculative_algorithm="none")


def test_a_rank_whose_spawning_rank_is_killed_ends(target, tmp_path):
    """Before the group forms no connection tells it; it watches its parent."""
    pid_file = tmp_path / "pid"
    os.symlink(target, str(pid_file) + ".model")
    with one_intra_op_thread():
        rank_0 = mp.get_context("spawn").Process(
            target=_stall_in_the_rendezvous, args=(str(pid_file),)
        )
        rank_0.start()
    follower = None
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() and time.monotonic() < deadline and rank_0.is_alive():
            time.sleep(0.1)
        follower = int(pid_file.read_text())
        os.kill(rank_0.pid, signal.SIGKILL)
        assert _gone(follower, within_s=30), "the spawned rank outlived rank 0"
    finally:
        rank_0.kill()
        rank_0.join(10)
        if follower is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(follower, signal.SIGKILL)


def _hang_a_rank(target: str, pid_file: str) -> None:
    from specserve import LLM
    from specserve.engine import tensor_parallel

    tensor_parallel.STEP_TIMEOUT_S = 3.0
    llm = LLM(target, tensor_parallel_size=2, speculative_algorithm="none")
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    follower = llm.engine.parallel.processes[0].pid
    Path(pid_file).write_text(str(follower))
    os.kill(follower, signal.SIGINT)  # (ignored: rank 0 stops the ranks)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    os.kill(follower, signal.SIGSTOP)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=64))  # waits for the stopped rank


def test_a_hung_rank_ends_rank_0_after_the_step_bound(target, tmp_path):
    pid_file = tmp_path / "pid"
    try:
        status, detail = run_spawned(_hang_a_rank, target, str(pid_file), timeout_s=120)
    finally:
        if pid_file.exists():  # (stopped: only SIGKILL ends it)
            follower = int(pid_file.read_text())
            with contextlib.suppress(ProcessLookupError):
                os.kill(follower, signal.SIGKILL)
    assert (status, detail) == ("exit", 1)  # after 3 s, not the collectives' 30 minutes


def _interrupt_a_step_then_close(target: str) -> dict:
    from specserve import LLM, ConfigError
    from specserve.core.errors import TensorParallelError

    llm = LLM(target, tensor_parallel_size=2, speculative_algorithm="none")
    try:
        LLM(target, tensor_parallel_size=2, speculative_algorithm="none")
    except ConfigError as e:
        second = str(e)
    follower = llm.engine.parallel.processes[0].pid
    forward, calls = llm.engine.runner.model.forward, []

    def interrupted(*args, **kwargs):  # rank 0 only: its plan is out, the other rank waits
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    llm.engine.runner.model.forward = interrupted
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=16))
    except KeyboardInterrupt:
        pass
    start = time.monotonic()
    try:  # its collectives would pair with the interrupted step's: refused at once
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    except TensorParallelError as e:
        again = (str(e), time.monotonic() - start < 5)
    start = time.monotonic()
    llm.close()  # did wait for the ranks inside the interrupted step's collectives
    return {
        "again": again,
        "second": second,
        "close_s": time.monotonic() - start,
        "follower_gone": _gone(follower, 10),
    }


def test_close_after_an_interrupted_step_stops_the_ranks(target):
    status, out = run_spawned(_interrupt_a_step_then_close, target, timeout_s=120)
    assert status == "ok", out
    assert out["second"].startswith("this process holds a tensor-parallel engine already")
    assert out["again"][0].startswith("a tensor-parallel step of this engine was interrupted")
    assert out["again"][1]  # (it hung, then ended the process, or read a plan from tensors)
    assert out["close_s"] < 60 and out["follower_gone"]


def _idle_past_the_timeout(target: str) -> list:
    from datetime import timedelta

    from specserve import LLM
    from specserve.engine import tensor_parallel

    # (every rank's collectives wait this long: rank 0 hands its timeout to those it spawns)
    tensor_parallel.COLLECTIVE_TIMEOUT = timedelta(seconds=12)
    with LLM(target, tensor_parallel_size=2, speculative_algorithm="none") as llm:
        params = SamplingParams(max_tokens=4)
        first = llm.generate([[5, 6, 7]], params)[0].token_ids
        time.sleep(20)  # idle: the other rank waits for a plan past its timeout
        return [first, llm.generate([[5, 6, 7]], params)[0].token_ids]


def test_an_engine_idle_longer_than_the_collective_timeout_goes_on(target):
    """Rank 0 idle (a server without traffic, an LLM between calls) sends the other ranks
    plans of no step: they wait for plans inside a collective, which timed out and ended
    the process (after 30 minutes; 12 s here)."""
    status, out = run_spawned(_idle_past_the_timeout, target, timeout_s=120)
    assert status == "ok", out
    assert out[0] == out[1] and len(out[0]) == 4


def _drop_then_reuse(target: str) -> dict:
    import gc

    from specserve import LLM, SpecserveError

    llm = LLM(target, tensor_parallel_size=2, speculative_algorithm="none")
    dropped = llm.engine.parallel.processes[0].pid
    del llm
    gc.collect()  # (its ranks go with it; the group too)
    out = {"dropped_gone": _gone(dropped, 10)}
    llm = LLM(target, tensor_parallel_size=2, speculative_algorithm="none")
    out["tokens"] = len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].token_ids)
    llm.close()
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    except SpecserveError as e:
        out["after_close"] = str(e)
    return out


def test_a_dropped_engine_takes_its_ranks_and_a_closed_one_says_so(target):
    status, out = run_spawned(_drop_then_reuse, target, timeout_s=120)
    assert status == "ok", out
    assert out == {
        "dropped_gone": True,
        "tokens": 4,
        "after_close": "this tensor-parallel engine is closed",
    }


def test_a_follower_whose_group_is_gone_says_so_in_one_line():
    """A rank > 0 whose collective fails because a peer left (rank 0 killed mid-forward)
    ends with a TensorParallelError (the CLI's one line), as a plan it cannot receive does;
    a failure of its own keeps its traceback."""
    from types import SimpleNamespace

    from specserve.core.errors import TensorParallelError
    from specserve.core.kernel_options import current
    from specserve.engine.engine import LLMEngine

    def follower_failing_with(message):
        def next_plan():
            raise RuntimeError(message)

        engine = LLMEngine.__new__(LLMEngine)
        engine.kernel_options = current()
        engine.follower = SimpleNamespace(next=next_plan)
        engine.parallel = SimpleNamespace(rank=1)
        return engine

    with pytest.raises(TensorParallelError, match="rank 1 lost the tensor-parallel group"):
        follower_failing_with("[pair.cc:553] Connection closed by peer [127.0.0.1]:1").follow()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        follower_failing_with("mat1 and mat2 shapes cannot be multiplied").follow()
