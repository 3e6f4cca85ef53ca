"""The engine process: owns an LLMEngine and runs its step loop, fed through its inbox.

The HTTP process sends `AddRequests`, `AbortRequests` and `Shutdown` (server/messages.py);
this process answers with one `StepReport` per loop turn carrying every request's output
delta of the step, the engine's stats and the step timings. Deltas, not cumulative outputs,
cross the process boundary so the bytes pickled per step stay proportional to the tokens
produced. After a second without a report its outbox thread sends a heartbeat (an empty
report stamped with the loop's last turn), so the HTTP process can tell a stopped or hung
engine from a busy one (engine_watch.py's `EngineWatch`).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection

from specserve.core.config import EngineConfig
from specserve.core.errors import InvalidRequestError, SpecserveError
from specserve.server.inbox import Inbox
from specserve.server.messages import (
    AbortRequests,
    AddRequest,
    AddRequests,
    EngineInfo,
    Fatal,
    LoadFailed,
    Ready,
    RequestError,
    Shutdown,
    StepReport,
    Stopped,
)

_IDLE_POLL_S = 0.5  # how often an idle engine checks that its parent is still alive
HEARTBEAT_S = 1.0  # the longest the HTTP process goes without a message once serving
# The engine's whole stats (~45 figures for /metrics) cost ~20 us a loop turn to gather and
# pickle on a 2-core CPU, where the default model's plain steps take ~0.6 ms on the H200:
# sent this often while steps run (scrapes come every few seconds), and at every idle.
STATS_EVERY_S = 0.05


def run_engine(
    config: EngineConfig, inbox: Connection, conn: Connection, log_level: int = logging.INFO
) -> None:
    """Entry point of the engine process (spawned by EngineClient). It ignores SIGINT and
    SIGTERM: the HTTP process drains and then stops it (a Ctrl-C in the terminal, or a
    service manager signalling the whole process group, reaches both); if the HTTP process
    is gone, the engine notices and exits, while it loads too (`_watch_parent`). It logs at
    `log_level` (the server's) on stderr, as the HTTP process does."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    loaded = threading.Event()
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(
            target=_watch_parent, args=(parent, loaded), name="engine-parent", daemon=True
        ).start()
    outbox = Outbox(conn)
    try:
        _run(config, Inbox(inbox), outbox, loaded)
    finally:
        outbox.close()
        gc.unfreeze()  # let interpreter shutdown collect everything (native bindings check)


def _watch_parent(parent, loaded: threading.Event) -> None:
    """Until the model is loaded: end this process at once when the HTTP process is gone
    (killed, or ended by a signal, while it started: nobody would use what loads, and
    loading can take minutes). Once loaded the loop checks between turns and stops in
    order."""
    while not loaded.wait(_IDLE_POLL_S):
        if not parent.is_alive():
            os._exit(1)


def _run(config: EngineConfig, inbox: Inbox, outbox: Outbox, loaded: threading.Event) -> None:
    try:
        from specserve.engine.engine import LLMEngine

        _leave_a_core_for_http(config)
        engine = LLMEngine(config)
        _one_host_thread_on_a_gpu(config)
        # Everything loaded so far lives as long as the process: keep the collector from
        # walking it (a full collection in a step gap would cost tens of milliseconds).
        gc.collect()
        gc.freeze()
    except Exception as e:  # report any load failure to the parent, which exits with it
        user = isinstance(e, (SpecserveError, ValueError))
        outbox.send(LoadFailed(user, f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    finally:
        loaded.set()
    info = EngineInfo(
        model_name=engine.source.name,
        vocab_size=engine.model_config.vocab_size,
        max_model_len=engine.max_model_len,
        kv_capacity_tokens=engine.kv.capacity_tokens,
        kv_pages_total=engine.kv.allocator.num_usable,
        max_num_seqs=config.scheduler.max_num_seqs,
        simulated_acceptance=engine.spec is not None and engine.spec.simulate_rate is not None,
        eos_token_ids=tuple(sorted(engine.eos_token_ids)),
    )
    outbox.send(Ready(info))
    try:
        EngineLoop(engine, inbox, outbox).run()
    except BrokenPipeError:
        pass  # the HTTP process is gone; nothing to report to
    except Exception:
        outbox.send(Fatal(traceback.format_exc()))


class Outbox:
    """Sends messages to the HTTP process from its own thread, so a step never waits for
    the HTTP process to read (pickling and pipe writes happen off the step loop).

    Once the loop runs (`loop_at` set, by the loop at every turn) the thread sends a
    heartbeat when nothing went out for HEARTBEAT_S: an empty StepReport whose `sent_at`
    is when the loop last began a turn. It beats through a long step (the step does not
    hold this thread up), so only a stopped or hung process falls silent, and the stamp
    tells how long the current turn has run."""

    def __init__(self, conn: Connection, heartbeat_s: float = HEARTBEAT_S):
        self.conn = conn
        self.pending: queue.SimpleQueue = queue.SimpleQueue()
        self.broken = False
        self.heartbeat_s = heartbeat_s
        self.loop_at: float | None = None  # (time.monotonic) the loop's last turn began
        self.thread = threading.Thread(target=self._run, name="engine-outbox", daemon=True)
        self.thread.start()

    def send(self, msg) -> None:
        if self.broken:
            raise BrokenPipeError("the HTTP process stopped reading")
        # Pickled here, written by the thread: a write to a full pipe then blocks only the
        # thread, and the thread never holds the GIL for long.
        self.pending.put(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _run(self) -> None:
        while True:
            try:
                buf = self.pending.get(timeout=self.heartbeat_s)
            except queue.Empty:
                if self.loop_at is None:
                    continue
                buf = pickle.dumps(StepReport(sent_at=self.loop_at))
            if buf is None:
                return
            try:
                self.conn.send_bytes(buf)
            except OSError:
                self.broken = True
                return

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush what is queued, then stop the thread."""
        self.pending.put(None)
        self.thread.join(timeout_s)
        self.conn.close()


def _leave_a_core_for_http(config: EngineConfig) -> None:
    """On CPU, intra-op threads on every core fight the HTTP process for CPU time, and
    OpenMP workers that spin while a core is taken slow steps down by an order of magnitude;
    so the engine uses one core less unless OMP_NUM_THREADS says otherwise."""
    if config.load.torch_device().type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))


def _one_host_thread_on_a_gpu(config: EngineConfig) -> None:
    """On a GPU, once loaded, the engine's host tensor work is a step's bookkeeping (a
    grammar bitmask of 64 rows is 98k integers): intra-op workers woken for each such op,
    then spinning beside xgrammar's fill threads and the step loop, cost more than they
    save, so the engine runs them on its own thread unless OMP_NUM_THREADS says otherwise
    (as vLLM's workers do). Issue 32: at 64 constrained rows the H200's step grew by ~6 ms
    of host work that no CPU run reproduces; `OMP_NUM_THREADS` set gives the old way, for
    the comparison."""
    if config.load.torch_device().type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)


class EngineLoop:
    """Drains the inbox between steps, steps while there is work, reports each turn."""

    def __init__(self, engine, inbox: Inbox | queue.Queue, outbox: Outbox):
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.report = StepReport()
        self.dirty = False  # something changed that the HTTP side has not heard of
        self.last_step_end: float | None = None
        # request id -> when it was taken in, until its first tokens (or its end) are reported
        self.added_at: dict[str, float] = {}
        self.parent = mp.parent_process()
        self.stats_at = -STATS_EVERY_S  # when the whole stats were last sent (monotonic s)

    def run(self) -> None:
        while True:
            self.outbox.loop_at = time.monotonic()  # (the heartbeat's stamp)
            if not self._drain(block=not self.engine.has_unfinished()):
                break
            if self.engine.has_unfinished():
                self._step()
            if self.dirty:
                self._send()
        self.outbox.loop_at = None  # (stopping: no heartbeat after the last word)
        self.engine_abort_all()
        self.engine.close()  # (tensor parallelism: the other ranks stop)
        self._send()  # final stats: nothing running, every page free
        self.outbox.send(Stopped())

    def _step(self) -> None:
        start = time.perf_counter()
        if self.last_step_end is not None:
            self.report.gap_s.append(start - self.last_step_end)
        outputs = self.engine.step()
        end = time.perf_counter()
        self.report.step_s.append(end - start)
        self.report.outputs += [_delta(o, self.added_at) for o in outputs]
        self.dirty = True
        # Only back-to-back steps count: time spent idle without work is not a gap.
        self.last_step_end = end if self.engine.has_unfinished() else None

    def _send(self) -> None:
        # The whole stats (/metrics) at most every STATS_EVERY_S while steps run, and when
        # the engine goes idle; in between the two counts admission reads (`StepReport`).
        now = time.monotonic()
        if now - self.stats_at >= STATS_EVERY_S or not self.engine.has_unfinished():
            self.report.stats, self.stats_at = self.engine.stats(), now
        else:
            self.report.stats = self.engine.queue_lengths()
        self.report.sent_at = now
        self.outbox.send(self.report)
        self.report = StepReport()
        self.dirty = False

    def _drain(self, block: bool) -> bool:
        """Handle every queued message; wait for one first when idle. False on shutdown."""
        while True:
            try:
                msg = self.inbox.get(timeout=_IDLE_POLL_S) if block else self.inbox.get_nowait()
            except EOFError:  # the HTTP process is gone
                return False
            except queue.Empty:
                if block:
                    self.outbox.loop_at = time.monotonic()  # (idle, not stuck)
                parent_gone = self.parent is not None and not self.parent.is_alive()
                if block and (parent_gone or self.outbox.broken):
                    return False
                if block:
                    continue
                return True
            block = False
            if isinstance(msg, Shutdown):
                return False
            self.dirty = True
            if isinstance(msg, AddRequests):
                for req in msg.requests:
                    self._add(req)
            elif isinstance(msg, AbortRequests):
                for rid in msg.request_ids:
                    self.engine.abort_request(rid)
                    self.added_at.pop(rid, None)
                if not self.engine.has_unfinished():
                    self.last_step_end = None

    def _add(self, req: AddRequest) -> None:
        try:
            self.engine.add_request(req.prompt_token_ids, req.params, req.request_id)
            self.added_at[req.request_id] = time.monotonic()
        except InvalidRequestError as e:
            self.report.errors.append(RequestError(req.request_id, str(e), e.field, 400))
        except Exception as e:
            self.report.errors.append(
                RequestError(req.request_id, f"{type(e).__name__}: {e}", None, 500)
            )

    def engine_abort_all(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
        self.added_at.clear()


def _delta(out, added_at: dict[str, float]) -> tuple:
    """A RequestOutput as OutputDelta fields (a tuple, see OutputDelta); `added_at`: when
    requests were taken in, each sent (and dropped) with its first tokens."""
    n, finished = out.num_new_tokens, out.finished
    added = added_at.pop(out.request_id, None) if n or finished else None
    new_lp = None
    if out.new_logprobs:
        new_lp = [(lp.logprob, [tuple(t) for t in lp.top]) for lp in out.new_logprobs]
    return (
        out.request_id,
        out.delta_text,
        out.token_ids[-n:] if n else [],
        new_lp,
        finished,
        out.finish_reason,
        # The request's speculation totals, once: metrics add them up when it finishes.
        out.spec_stats if finished else None,
        out.num_cached_tokens if finished else None,
        _prompt_logprobs(out)
        if out.prompt_logprobs is not None and n == len(out.token_ids)
        else None,
        added if n else None,
    )


def _prompt_logprobs(out) -> list:
    """A request's prompt logprobs as OutputDelta carries them (sent with its first delta)."""
    first, *rest = out.prompt_logprobs
    return [first] + [(lp.logprob, [tuple(t) for t in lp.top]) for lp in rest]
