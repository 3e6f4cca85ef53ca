"""The engine process's loop in-process (no HTTP): adds, engine-side refusals, aborts,
shutdown; plus the pieces of the server that need no running server."""

from __future__ import annotations

import multiprocessing as mp
import queue

import pytest

from specserve.core.config import EngineConfig
from specserve.core.sampling_params import SamplingParams, choice_seed
from specserve.engine.engine import LLMEngine
from specserve.server.engine_proc import EngineLoop, Outbox
from specserve.server.errors import _field_path
from specserve.server.messages import (
    AbortRequests,
    AddRequest,
    AddRequests,
    Fatal,
    OutputDelta,
    Shutdown,
    StepReport,
    Stopped,
)
from specserve.server.openai_format import TokenText


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig.from_flags(model=str(tiny_llama)))


def _messages(conn, until: type) -> list:
    out = []
    while True:
        msg = conn.recv()
        out.append(msg)
        if isinstance(msg, until):
            return out


def test_loop_adds_refuses_aborts_and_stops(engine):
    inbox: queue.Queue = queue.Queue()
    reader, writer = mp.Pipe(duplex=False)
    outbox = Outbox(writer)
    ids = engine.tokenize("The quick brown fox")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    inbox.put(
        AddRequests(
            [
                AddRequest("a", ids, params),
                AddRequest("a", ids, params),
                AddRequest("b", ids, SamplingParams(max_tokens=400, ignore_eos=True)),
            ]
        )
    )
    loop = EngineLoop(engine, inbox, outbox)
    # Run turns by hand until "a" finishes, then abort "b" and shut down.
    deltas: list[OutputDelta] = []
    errors = []
    while not any(d.finished for d in deltas if d.request_id == "a"):
        loop._drain(block=False)
        loop._step()
        loop._send()
        report = reader.recv()
        assert isinstance(report, StepReport)
        deltas += [OutputDelta(*t) for t in report.outputs]
        errors += report.errors
    assert [(e.request_id, e.status, e.field) for e in errors] == [("a", 400, "id")]
    a = [d for d in deltas if d.request_id == "a"]
    assert sum(len(d.new_token_ids) for d in a) == 6 and a[-1].finish_reason == "length"
    expected = engine.tokenizer.decode(
        sum((d.new_token_ids for d in a), []), skip_special_tokens=True
    )
    assert "".join(d.delta_text for d in a) == expected
    assert loop.report.gap_s == [] and engine.stats()["kv_pages_used"] > 0  # "b" still runs
    inbox.put(AbortRequests(["b"]))
    inbox.put(Shutdown())
    loop.run()
    msgs = _messages(reader, Stopped)
    assert msgs[-2].stats["kv_pages_used"] == 0  # the abort was reported before stopping
    assert not engine.has_unfinished()
    outbox.close()


def test_reports_carry_the_whole_stats_now_and_then_and_at_idle(engine, monkeypatch):
    """While steps run, a report carries the engine's whole stats at most every
    STATS_EVERY_S and the queue lengths (what admission reads) in between; the report as
    the engine goes idle carries them whole, so /metrics after a run is exact; the client
    keeps the last whole stats under the fresher queue lengths."""
    from specserve.server import engine_proc
    from specserve.server.engine_client import EngineClient
    from specserve.server.metrics import ServerMetrics

    clock = [100.0]
    monkeypatch.setattr(engine_proc.time, "monotonic", lambda: clock[0])
    reader, writer = mp.Pipe(duplex=False)
    outbox = Outbox(writer)
    loop = EngineLoop(engine, queue.Queue(), outbox)
    client = EngineClient.__new__(EngineClient)
    client.stats, client._tracked, client.metrics = {}, {}, ServerMetrics()
    ids = engine.tokenize("The quick brown fox")
    for i in range(2):
        engine.add_request(ids, SamplingParams(max_tokens=8, ignore_eos=True), f"s{i}")
    kinds = []
    while engine.has_unfinished():
        loop._step()
        loop._send()
        report = reader.recv()
        client._on_report(report)
        kinds.append("whole" if "kv_pages_used" in report.stats else sorted(report.stats))
        assert client.stats["running"] == report.stats["running"] == len(engine.scheduler.running)
        assert "kv_pages_total" in client.stats  # (the last whole stats, kept)
        clock[0] += 0.4 * engine_proc.STATS_EVERY_S  # a whole report every third turn
    assert kinds[0] == "whole" and kinds[-1] == "whole"  # (the first turn, and at idle)
    assert ["running", "waiting"] in kinds  # (before: every report whole)
    whole = [i for i, k in enumerate(kinds) if k == "whole"]
    assert all(b - a <= 3 for a, b in zip(whole, whole[1:]))
    assert client.stats["kv_pages_used"] == 0 and client.stats["running"] == 0
    outbox.close()


def test_choice_seeds_are_distinct_and_stable():
    seeds = [choice_seed(42, i) for i in range(64)]
    assert seeds[0] == 42 and len(set(seeds)) == 64
    assert seeds == [choice_seed(42, i) for i in range(64)]
    assert all(0 <= s < 2**62 for s in seeds[1:])


def test_token_bytes_rebuild_multibyte_text(engine):
    text = TokenText(engine.tokenizer)
    word = "naïve café 你好 🙂"
    ids = engine.tokenizer.encode(word, add_special_tokens=False)
    assert bytes(b for t in ids for b in text.get(t)[1]) == word.encode()
    partial = [t for t in ids if text.get(t)[0].startswith("bytes:")]
    assert partial, "the tiny tokenizer splits some characters across tokens"


def test_error_field_paths():
    assert _field_path(("body", "messages", 0, "content")) == "messages[0].content"
    assert _field_path(("body", "stop", "list[constrained-str]", 1)) == "stop[1]"
    assert _field_path(("body",)) is None


def test_a_crashed_engine_is_logged_whole_and_reported_by_its_error(caplog):
    """The engine's traceback goes to the server's log; every waiting stream gets the error
    itself (its last line), not the engine's internals."""
    import asyncio
    import logging

    from specserve.server.engine_client import EngineClient, EngineDeadError, _Tracked
    from specserve.server.request_stream import RequestStream

    client = EngineClient.__new__(EngineClient)
    client.dead_reason, client.on_dead, client.shutting_down = None, None, False
    stream = RequestStream(["a"])
    client._tracked = {"a": _Tracked(stream, 0, 0.0)}
    trace = (
        'Traceback (most recent call last):\n  File "engine.py", line 1, in step\n'
        "RuntimeError: a step's input token is neither on the host nor in flight\n"
    )
    with caplog.at_level(logging.ERROR, logger="specserve"):
        client._dispatch(Fatal(trace))
    assert client.dead_reason == "crashed" and not client._tracked
    assert 'File "engine.py", line 1' in caplog.text

    async def first():
        return await stream.__anext__()

    try:
        asyncio.run(first())
    except EngineDeadError as e:
        assert str(e) == (
            "the engine process failed: RuntimeError: a step's input token is "
            "neither on the host nor in flight"
        )
    else:
        raise AssertionError("the stream did not end with the engine's error")


def test_deltas_queued_behind_each_other_come_out_as_one():
    """An HTTP process behind the engine sends one event for a choice's queued deltas: the
    same text, tokens and logprobs, the last one's finish; deltas of other choices, errors
    and the end keep their order."""
    import asyncio

    from specserve.server.messages import OutputDelta
    from specserve.server.request_stream import END, RequestStream

    def delta(rid, text, ids, finished=False, stats=None):
        lps = [(-0.5, [(i, -0.5)]) for i in ids]
        return OutputDelta(rid, text, ids, lps, finished, "stop" if finished else None, stats)

    stream = RequestStream(["a", "b"])
    for item in (
        (0, delta("a", "He", [1])),
        (0, delta("a", "llo", [2, 3], stats="s1")),
        (0, delta("a", "!", [4])),
        (1, delta("b", "x", [5])),
        (1, delta("b", "y", [6], finished=True)),
        (0, delta("a", ".", [7], finished=True)),
        END,
    ):
        stream._put(item)

    async def drain():
        return [item async for item in stream]

    out = asyncio.run(drain())
    assert [(i, d.delta_text, d.new_token_ids, d.finished) for i, d in out] == [
        (0, "Hello!", [1, 2, 3, 4], False),
        (1, "xy", [5, 6], True),
        (0, ".", [7], True),
    ]
    assert out[0][1].new_logprobs == [(-0.5, [(i, -0.5)]) for i in (1, 2, 3, 4)]
    assert out[0][1].spec_stats == "s1" and out[1][1].finish_reason == "stop"

    # one delta at a time (the HTTP process keeps up): each as it came, nothing merged
    stream = RequestStream(["a"])

    async def one_by_one():
        got = []
        for i in range(3):
            stream._put((0, delta("a", str(i), [i])))
            got.append(await stream.__anext__())
        stream._put(END)
        return got, [x async for x in stream]

    got, rest = asyncio.run(one_by_one())
    assert [d.delta_text for _, d in got] == ["0", "1", "2"] and rest == []


@pytest.mark.parametrize(
    ("device", "env", "want"),
    [("cuda", {}, [1]), ("cuda", {"OMP_NUM_THREADS": "8"}, []), ("cpu", {}, [])],
)
def test_engine_process_host_threads_on_a_gpu(monkeypatch, device, env, want):
    """On a GPU the engine process, once loaded, runs torch's host work on one thread unless
    OMP_NUM_THREADS says otherwise; on CPU this leaves the threads alone."""
    import torch

    from specserve.server import engine_proc

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    config = EngineConfig.from_flags(model="tiny", device=device)
    engine_proc._one_host_thread_on_a_gpu(config)
    assert calls == want


def test_a_request_the_engine_refuses_counts_as_an_error_not_an_abort():
    """/metrics' finish reasons: a request the engine refused (and its sibling choices)
    finished by "error"; "abort" is the client's leaving or the server's shutdown."""
    from specserve.server.engine_client import EngineClient, _Tracked
    from specserve.server.messages import RequestError, StepReport
    from specserve.server.metrics import ServerMetrics
    from specserve.server.request_stream import RequestStream

    client = EngineClient.__new__(EngineClient)
    client.metrics, client.stats = ServerMetrics(), {}
    client._proc = type("Gone", (), {"is_alive": lambda self: False})()
    stream = RequestStream(["r-0", "r-1"])
    client._tracked = {"r-0": _Tracked(stream, 0, 0.0), "r-1": _Tracked(stream, 1, 0.0)}
    client._on_report(StepReport(errors=[RequestError("r-0", "no", "prompt", 400)]))
    finished = client.metrics.finished
    assert finished.labels("error")._value.get() == 2 and not client._tracked
    assert finished.labels("abort")._value.get() == 0


def test_wait_ready_passes_over_a_heartbeat_ahead_of_ready():
    """The engine's outbox thread can time out waiting just as Ready is queued and find the
    loop started when it wakes, so a heartbeat goes out first: start-up took it for Ready
    ('StepReport' object has no attribute 'info') and the server exited, now and then on a
    busy CPU."""
    from specserve.server.engine_client import EngineClient
    from specserve.server.engine_watch import EngineWatch
    from specserve.server.messages import EngineInfo, Ready

    class Alive:
        def is_alive(self):
            return True

    reader, writer = mp.Pipe(duplex=False)
    info = EngineInfo("m", 100, 64, 1024, 64, 4, False, (2,))
    writer.send(StepReport(sent_at=1.0))
    writer.send(Ready(info))
    client = EngineClient.__new__(EngineClient)
    client._conn, client._proc = reader, Alive()
    client.watch = EngineWatch(15.0, 300.0)
    assert client.wait_ready(timeout_s=5.0) == info
    assert client.stats["kv_pages_total"] == 64
