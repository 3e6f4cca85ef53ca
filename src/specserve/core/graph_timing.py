"""CUDA graph helpers every floor may need: capturing without the cyclic collector, and timing
a captured graph's replays."""

from __future__ import annotations

import contextlib
import gc
import statistics

import torch


@contextlib.contextmanager
def no_collection_while_capturing():
    """Keep Python's cyclic garbage collector off until the block ends. An engine dropped
    earlier in the process (a benchmark's previous configuration, a test's) is freed only
    by the collector; if it ran mid-capture, the old engine's CUDA graphs would be destroyed
    inside the new capture, which CUDA forbids: the capture is invalidated and start-up
    fails at a later launch (seen on the H200: "operation failed due to a previous error
    during capture"). torch.cuda.graph no longer collects before each capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median device time (ms) of `reps` replays of a captured (and uploaded) graph, each
    between its own pair of CUDA events."""
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)
