"""Start-up tuning of the GEMV plan by whole-step time: each projection's choice is tried in
the target's captured decode (and verify) forward, with every other choice as it stands,
and kept where the step gets faster.

Selection (tuning/gemv_select.py) times each candidate on its own, over rotating weights.
Between its real neighbours a kernel can rank differently: the next kernel launches early
under PDL and overlaps its tail, a tile that ramps up slowly waits on the small kernel
before it, and at batch 1 a whole layer is ~14 kernels of a few microseconds of boundary
each. On the H200 at batch 1 the qkv projection's standalone winner was ~2 us a layer slower
in a layer's chain than another tile, and cuBLAS's gate_up ~1.5 us slower than a Triton tile.
So the plan's choices for the row buckets a
tuning step reaches are revisited here, one projection (plan key) at a time, largest first
(coordinate descent, one pass): each of its candidates (cuBLAS and the configurations
selection proposes for the bucket) is installed in the plan, the step is captured in a CUDA
graph and replayed, and the fastest stays if it beats the current choice by `margin`.

The steps run on the static buffers of the engine's graph runner, every request at a
`context`-token length whose pages are all the scratch page 0 (nothing real is read or
written; the buffers get their padding values back afterwards). The buckets up to
SHARED_ROWS share one choice (batch invariance: decode and verify rows must round alike), so
they are tuned together, by the summed time of a batch-1 decode step and, for speculative
engines, a batch-1 verify step.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from specserve.core.graph_timing import no_collection_while_capturing, replay_ms
from specserve.kernels.gemv_plan import GemvPlan
from specserve.runtime.cuda_graphs import CudaGraphRunner

log = logging.getLogger(__name__)


@dataclass
class TuningReport:
    """What tuning did: per tuned group, the step time before and after (ms, summed over its
    steps), and each change made (plan key, old choice, new choice)."""

    steps_ms: dict[str, tuple[float, float]] = field(default_factory=dict)
    changes: list[tuple[tuple, str, str]] = field(default_factory=list)
    evaluations: int = 0
    seconds: float = 0.0


def _label(cfg) -> str:
    return str(cfg) if cfg is not None else "torch"


def fill_scratch_step(
    graphs: CudaGraphRunner, batch: int, q: int, context: int, slot: int = 0
) -> None:
    """Set a graph runner's static buffers to a step of `batch` requests of q tokens, every
    request at `context` tokens (at most the runner's) on the scratch page 0, its new K/V
    stored at `slot` (-1: not stored). `reset_scratch_step` puts the padding values back."""
    ctx = min(context, graphs.max_seq_len)
    pages = -(-ctx // graphs.kv_layers[0][0].shape[1])
    n = batch * q
    graphs.positions[:n] = (torch.arange(n, device=graphs.positions.device) % q) + ctx - q
    graphs.slot_mapping[:n] = slot
    graphs.seq_lens[:batch] = ctx
    graphs.block_tables[:batch, :pages] = 0


def reset_scratch_step(graphs: CudaGraphRunner) -> None:
    graphs.positions.zero_()
    graphs.slot_mapping.zero_()
    graphs.seq_lens.fill_(1)
    graphs.block_tables.zero_()


class StepTimer:
    """Device time of a captured target step of (batch, tokens per request) on a graph
    runner's static buffers, all requests at `context` tokens on the scratch page."""

    def __init__(self, graphs: CudaGraphRunner, context: int, reps: int):
        self.graphs, self.context, self.reps = graphs, context, reps

    def _fill(self, batch: int, q: int) -> None:
        fill_scratch_step(self.graphs, batch, q, self.context)

    def _reset(self) -> None:
        reset_scratch_step(self.graphs)

    @torch.inference_mode()
    def keys_used(self, steps: list[tuple[int, int]]) -> set | None:
        """The plan keys the target's forward looks up in these steps (run eagerly once
        each); None without a plan."""
        plan = getattr(self.graphs.model, "gemv_plan", None)
        if plan is None:
            return None
        plan.asked = set()
        try:
            for batch, q in steps:
                self._fill(batch, q)
                self.graphs._forward(batch, q)
            torch.cuda.synchronize()
            return plan.asked
        finally:
            plan.asked = None
            self._reset()

    @torch.inference_mode()
    def __call__(self, batch: int, q: int) -> float:
        self._fill(batch, q)
        try:
            side = torch.cuda.Stream()  # eagerly first: compilation, cuBLAS set-up
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.graphs._forward(batch, q)
            torch.cuda.current_stream().wait_stream(side)
            # A private memory pool, freed with the graph (a pool whose graphs are all gone
            # cannot take another capture: the caching allocator asserts).
            graph = torch.cuda.CUDAGraph()
            with no_collection_while_capturing(), torch.cuda.graph(graph):
                self.graphs._forward(batch, q)
            graph.replay()  # uploads the graph
            return replay_ms(graph, self.reps)
        finally:
            self._reset()


def tune_plan(
    plan: GemvPlan,
    groups: dict[str, tuple[list[tuple[int, int]], list[tuple]]],
    candidates,
    timer,
    margin: float = 0.003,
) -> TuningReport:
    """Coordinate descent over the plan's keys, per group: {name: ([(batch, tokens per
    request) steps to time], [plan keys tuned together: each a list of keys sharing one
    choice])}. `candidates(key)` lists a key's configurations (None: torch); `timer(batch,
    q)` times a step under the plan as it stands. Keys are taken largest weight first; a
    candidate replaces the current choice where the summed step time beats it by `margin`
    (a fraction) in a first timing and again when timed once more next to the current
    choice; a candidate that fails to run counts as infinitely slow. The report's times
    after tuning are measured afresh. Returns the report; the plan is changed in place."""
    report = TuningReport()
    start = time.perf_counter()

    def total(steps) -> float:
        """The steps' summed time under the plan as it stands; inf if a choice cannot run
        (a configuration this device lacks the resources for, say)."""
        report.evaluations += 1
        try:
            return sum(timer(b, q) for b, q in steps)
        except Exception as e:  # noqa: BLE001 (any launch failure: the candidate is out)
            log.debug("GEMV plan tuning: a candidate failed: %s", e)
            return math.inf

    for name, (steps, key_sets) in groups.items():
        first = best = total(steps)
        for keys in sorted(key_sets, key=lambda ks: -ks[0][1] * ks[0][2]):
            choice = plan.choices[keys[0]]
            current = winner = choice.config
            for cfg in candidates(keys[0]):
                if cfg == current:
                    continue
                plan.set_config(keys, cfg)
                t = total(steps)
                if t < best * (1 - margin):
                    # once more against the choice it would replace, so that one lucky
                    # capture does not decide
                    plan.set_config(keys, winner)
                    again = total(steps)
                    plan.set_config(keys, cfg)
                    t = max(t, total(steps))
                    if t < min(best, again) * (1 - margin):
                        best, winner = t, cfg
                    else:
                        best = min(best, again)
            plan.set_config(keys, winner, tuned=choice.tuned or winner != current)
            if winner != current:
                report.changes.append((keys[0], _label(current), _label(winner)))
        report.steps_ms[name] = (round(first, 4), round(total(steps), 4))  # measured afresh
    report.seconds = time.perf_counter() - start
    return report


def tune_engine_plan(
    graphs: CudaGraphRunner,
    plan: GemvPlan,
    candidates,
    shared_rows: int,
    verify_tokens: int = 0,
    context: int = 512,
    reps: int = 10,
) -> TuningReport:
    """Tune `plan` (the target's) in its own decode steps: the buckets up to `shared_rows`
    together at batch 1 (decode, and verify of `verify_tokens` per request when > 1), and
    the plan's largest row bucket, if the graph runner has that batch bucket, at that batch
    (decode). Only keys the steps look up are tuned."""
    timer = StepTimer(graphs, context, reps)
    one = [(1, 1)] + ([(1, verify_tokens)] if verify_tokens > 1 else [])
    one = [s for s in one if s[1] in graphs.q_lens]
    top = plan.row_buckets[-1]
    big = [(top, 1)] if top > shared_rows and top in graphs.batch_buckets else []
    used = timer.keys_used(one + big)  # the projections these steps run (logits too)
    key_sets: dict[tuple, list[tuple]] = {}
    for key in plan.choices:
        group = "shared" if key[0] <= shared_rows else str(key[0])
        key_sets.setdefault((group, key[1:]), []).append(key)
    groups: dict[str, tuple[list, list]] = {"shared": (one, []), str(top): (big, [])}
    for (group, _), keys in key_sets.items():
        if group in groups and (used is None or used & set(keys)):
            groups[group][1].append(keys)
    groups = {name: (steps, keys) for name, (steps, keys) in groups.items() if steps and keys}
    report = tune_plan(plan, groups, candidates, timer)
    log.info(
        "GEMV plan tuned in whole steps in %.1f s (%d steps timed): %s; %d changes",
        report.seconds,
        report.evaluations,
        ", ".join(f"{n} {a:.3f} -> {b:.3f} ms" for n, (a, b) in report.steps_ms.items()),
        len(report.changes),
    )
    return report
