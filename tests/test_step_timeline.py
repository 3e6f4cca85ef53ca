"""The step loop's device timeline on CUDA (engine/step_loop.py): three timing events a
step, recorded on the stream looked up once a step, and recorded again by later steps once
their times are read (no new events in steady state). CUDA's events are stood in for here,
so the bookkeeping runs on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specserve.engine.step_loop import StepLoop, StepTimes


class FakeEvent:
    made = 0

    def __init__(self, enable_timing=False):
        FakeEvent.made += 1
        self.t = None
        self.streams = []

    def record(self, stream=None):
        self.streams.append(stream)
        self.t = FakeEvent.clock
        FakeEvent.clock += 1.0

    def synchronize(self):
        assert self.t is not None

    def elapsed_time(self, end):
        return end.t - self.t


def _loop(reuse: bool) -> StepLoop:
    loop = StepLoop.__new__(StepLoop)
    loop.times, loop._timed, loop._last_end = StepTimes(), True, None
    loop._free_events, loop._stream = [], None
    loop.REUSE_EVENTS = reuse
    return loop


def _steps(loop: StepLoop, n: int, monkeypatch) -> list:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    stream = object()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    FakeEvent.made, FakeEvent.clock = 0, 0.0
    recorded = []
    inflight = None
    for i in range(n):  # overlap: step i is launched before step i - 1 is processed
        events = loop._events()
        for e in events:
            e.record(loop._stream)
        step = SimpleNamespace(events=events, after_idle=i == 0, host_ms=0.0)
        recorded.append(events)
        if inflight is not None:
            assert loop._record_times(inflight) == 1.0  # forward start to end
        inflight = step
    loop._record_times(inflight)
    return recorded


def test_timing_events_are_recorded_again_once_read(monkeypatch):
    loop = _loop(reuse=True)
    recorded = _steps(loop, 12, monkeypatch)
    assert FakeEvent.made <= 9  # two steps in flight, and the last one's end kept
    in_flight = [set(map(id, a)) | set(map(id, b)) for a, b in zip(recorded, recorded[1:])]
    assert all(len(ids) == 6 for ids in in_flight)  # never one event in two live steps
    assert len(loop.times.step_ms) == 12 and all(ms == 2.0 for ms in loop.times.step_ms)
    assert len(loop.times.gap_ms) == 11 and all(ms == 1.0 for ms in loop.times.gap_ms)
    streams = {id(s) for events in recorded for e in events for s in e.streams}
    assert len(streams) == 1 and None not in [s for e in recorded[0] for s in e.streams]


def test_without_reuse_every_step_makes_its_own(monkeypatch):
    loop = _loop(reuse=False)
    _steps(loop, 12, monkeypatch)
    assert FakeEvent.made == 36 and not loop._free_events
    assert list(loop.times.gap_ms) == [1.0] * 11
