"""Start-up choice of the GEMV tiles that verify steps of up to SHARED_ROWS requests run
(`GemvPlan.verify`).

Batch invariance has such a step look its GEMVs up by request count: its K + 1 rows per
request run the 16-row tile its requests' decode steps run (a program takes up to 4 row
blocks, kernels/gemv.py), so each row keeps its decode bits. That tile was chosen for 1-16
rows; at 32 or 64 rows a narrow one re-reads every row of x from L2 per program, and on the
H200 verify steps of 16 requests at K=3 took 8.1 ms against 6.2 with each bucket's own
tiles. Another 16-row tile with the same K split may give every
row the same bits (on the matrix units the sums of a row block do not depend on the tile's
width, warps or pipeline depth, as far as the device shows), so each of the engine's verify
steps that reaches a row bucket above SHARED_ROWS is tuned here, per projection, in the
whole step: a candidate (`gemv_configs.verify_candidates`) is kept only if the step's
hidden states and logits come out bit for bit as with the shared tile (`StepOutput`: random
token ids and cached keys, nothing written) and the captured step runs faster by `margin`,
twice. Every other row count and every decode step keeps the shared tile.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from specserve.kernels.gemv_plan import GemvPlan
from specserve.runtime.cuda_graphs import CudaGraphRunner, static_meta
from specserve.tuning.plan_tuning import StepTimer, fill_scratch_step, reset_scratch_step

log = logging.getLogger(__name__)


@dataclass
class VerifyTilesReport:
    """Per tuned step ("batch x tokens"): its time before and after (ms); each tile kept
    ((row bucket, N, K, dtype[, fusion]), shared tile, verify tile); candidates whose bits
    differed from the shared tile's."""

    steps_ms: dict[str, tuple[float, float]] = field(default_factory=dict)
    changes: list[tuple[tuple, str, str]] = field(default_factory=list)
    rejected: list[tuple[tuple, str]] = field(default_factory=list)
    skipped: int = 0  # candidates left untried when the budget ran out
    evaluations: int = 0
    compiled: int = 0  # Triton variants compiled before the search, in parallel
    compile_s: float = 0.0
    seconds: float = 0.0


class StepOutput:
    """The hidden states and logits of a target step of (batch, tokens per request) on a
    graph runner's static buffers, eagerly and deterministically: seeded random token ids,
    every request at `context` tokens whose keys and values are the scratch page 0, set to
    seeded random values before each call (timed steps store there in between), no K/V
    written (slots -1)."""

    def __init__(self, graphs: CudaGraphRunner, context: int, seed: int = 0):
        self.graphs, self.context = graphs, min(context, graphs.max_seq_len)
        gen = torch.Generator(device=graphs.input_ids.device).manual_seed(seed)
        self.pages = [
            torch.randn(cache[0].shape, generator=gen, device=cache.device).to(cache.dtype)
            for layer in graphs.kv_layers
            for cache in layer[:2]
        ]
        vocab = graphs.model.config.vocab_size
        self.ids = torch.randint(
            vocab, graphs.input_ids.shape, generator=gen, device=graphs.input_ids.device
        )

    @torch.inference_mode()
    def __call__(self, batch: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        g, n = self.graphs, batch * q
        for cache, page in zip((c for layer in g.kv_layers for c in layer[:2]), self.pages):
            cache[0].copy_(page)
        fill_scratch_step(g, batch, q, self.context, slot=-1)
        try:
            hidden, _ = g.model(
                self.ids[:n], static_meta(g, batch, q), g.kv_layers, g.backend, g.aux_layer_ids
            )
            logits = g.logits_head(hidden) if g.logits_head is not None else hidden
            return hidden.clone(), logits.clone()
        finally:
            reset_scratch_step(g)


def verify_steps(plan: GemvPlan, batch_buckets, q: int, shared_rows: int) -> dict:
    """{row bucket above shared_rows: (batch, q)}: the largest graph batch bucket of at most
    shared_rows requests whose verify step of q tokens each lands in that row bucket."""
    steps = {}
    for batch in sorted(batch_buckets):
        rows = batch * q
        if batch <= shared_rows < rows <= plan.max_rows:
            steps[plan.row_buckets[[b >= rows for b in plan.row_buckets].index(True)]] = (batch, q)
    return steps


def tune_verify_tiles(
    plan: GemvPlan,
    steps: dict,
    candidates,
    timer,
    output,
    shared_rows: int,
    margin: float = 0.003,
    keys_used=None,
    budget_s: float = 30.0,
) -> VerifyTilesReport:
    """For each (row bucket: (batch, q)) of `steps`, each plan key the step looks up
    (`keys_used(steps)`; default every key) whose shared choice is a Triton tile, largest
    weight first: try `candidates(shared tile, rows, key)` as the key's verify tile at that
    bucket; keep one whose `output(batch, q)` (tensors) equals the shared tile's bit for bit
    and whose `timer(batch, q)` beats the best so far by `margin` (a fraction), again when
    timed once more next to it. A candidate that fails to run is out. Steps go tallest
    first, each with an equal share of what is left of `budget_s`, past which its
    candidates are not tried (`skipped` counts them). The plan changes in place."""
    report = VerifyTilesReport()
    start = time.perf_counter()

    def timed(batch, q) -> float:
        report.evaluations += 1
        try:
            return timer(batch, q)
        except Exception as e:  # noqa: BLE001 (a launch failure: the candidate is out)
            log.debug("verify tiles: a candidate failed: %s", e)
            return math.inf

    # the tallest verify step first (16 requests: where the shared tile costs most); each
    # step an equal share of what is left of the budget
    for i, (vb, (batch, q)) in enumerate(sorted(steps.items(), reverse=True)):
        deadline = time.perf_counter() + (budget_s - (time.perf_counter() - start)) / (
            len(steps) - i
        )
        used = keys_used([(batch, q)]) if keys_used is not None else set(plan.choices)
        keys = [key for key, _ in shared_tiles(plan, used, shared_rows).values()]
        reference = output(batch, q)
        first = best = timed(batch, q)
        for key in sorted(keys, key=lambda k: (-k[1] * k[2], str(k[1:]))):
            shared, vkey = plan.choices[key].config, (vb, *key[1:])
            winner = plan.verify.get(vkey)
            for cfg in candidates(shared, batch * q, key):
                if time.perf_counter() > deadline:
                    report.skipped += 1
                    continue
                plan.verify[vkey] = cfg
                try:
                    same = all(map(torch.equal, output(batch, q), reference))
                except Exception as e:  # noqa: BLE001 (it cannot run here)
                    log.debug("verify tiles: %s failed: %s", cfg, e)
                    same = False
                if not same:
                    report.rejected.append((vkey, str(cfg)))
                    continue
                t = timed(batch, q)
                if t < best * (1 - margin):  # once more next to the tile it would replace
                    _set(plan, vkey, winner)
                    again = timed(batch, q)
                    plan.verify[vkey] = cfg
                    t = max(t, timed(batch, q))
                    if t < min(best, again) * (1 - margin):
                        best, winner = t, cfg
                    else:
                        best = min(best, again)
            _set(plan, vkey, winner)
            if winner is not None:
                report.changes.append((vkey, str(shared), str(winner)))
        report.steps_ms[f"{batch}x{q}"] = (round(first, 4), round(timed(batch, q), 4))
    report.seconds = time.perf_counter() - start
    return report


def shared_tiles(plan: GemvPlan, keys, shared_rows: int) -> dict:
    """{(N, K, dtype[, fusion]): (a plan key among `keys`, its tile)} for each projection
    whose choice for the buckets up to shared_rows (one, shared) is a Triton tile."""
    return {
        key[1:]: (key, plan.choices[key].config)
        for key in sorted(keys, key=str)
        if key in plan.choices and key[0] <= shared_rows and plan.choices[key].config is not None
    }


def _set(plan: GemvPlan, vkey: tuple, cfg) -> None:
    if cfg is None:
        plan.verify.pop(vkey, None)
    else:
        plan.verify[vkey] = cfg


def tune_engine_verify_tiles(
    graphs: CudaGraphRunner,
    plan: GemvPlan,
    shared_rows: int,
    verify_tokens: int,
    context: int = 512,
    reps: int = 10,
) -> VerifyTilesReport | None:
    """`tune_verify_tiles` for an engine's target: the verify steps of `verify_tokens` per
    request that its graph runner captures (None: no such step reaches past shared_rows)."""
    from specserve.kernels.gemv_configs import verify_candidates

    if verify_tokens not in graphs.q_lens or graphs.backend.name != "triton":
        return None  # (StepOutput's unstored slots: the Triton kernels skip them)
    steps = verify_steps(plan, graphs.batch_buckets, verify_tokens, shared_rows)
    if not steps:
        return None
    device = graphs.input_ids.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def candidates(shared, rows, key):
        return verify_candidates(shared, rows, key[1], key[2], sms)

    start = time.perf_counter()
    compiled = _compile(graphs.model, plan, steps, candidates, shared_rows, device)
    compile_s = time.perf_counter() - start
    timer = StepTimer(graphs, context, reps)
    report = tune_verify_tiles(
        plan,
        steps,
        candidates,
        timer,
        StepOutput(graphs, context),
        shared_rows,
        keys_used=timer.keys_used,
    )
    report.compiled, report.compile_s = compiled, compile_s
    log.info(
        "verify tiles tuned in %.1f s (%d steps timed; %d variants compiled first in "
        "%.1f s): %s; %d kept, %d with other bits, %d untried (budget)",
        report.seconds,
        report.evaluations,
        compiled,
        compile_s,
        ", ".join(f"{n} {a:.3f} -> {b:.3f} ms" for n, (a, b) in report.steps_ms.items()),
        len(report.changes),
        len(report.rejected),
        report.skipped,
    )
    return report


def compile_todo(plan: GemvPlan, steps: dict, candidates, shared_rows: int) -> dict:
    """{(N, K, dtype[, fusion]): [(rows, [shared tile, *candidates])]}: what the search of
    `steps` may run, per projection whose shared choice is a Triton tile (gemv_compile's
    `compile_tasks` form)."""
    todo: dict = {}
    for vb, (batch, q) in sorted(steps.items()):
        for key, (_, cfg) in shared_tiles(plan, plan.choices, shared_rows).items():
            todo.setdefault(key, []).append(
                (batch * q, [cfg, *candidates(cfg, batch * q, (vb, *key))])
            )
    return todo


def _compile(
    model, plan: GemvPlan, steps: dict, candidates, shared_rows: int, device: torch.device
) -> int:
    """Compile every GEMV variant the search may run (`compile_todo`, with the gated and
    rope epilogues' variants of the shapes that take them), in parallel as selection does,
    so that the search's budget goes to timing; returns how many."""
    import os

    from specserve.kernels import pdl
    from specserve.layers.linear import (
        gated_projections,
        gemv_weights,
        linear_biases,
        rope_projections,
    )
    from specserve.tuning.gemv_compile import compile_tasks, compile_variants

    weights = {key: [w for w in ws if w.stride(-1) == 1] for key, ws in gemv_weights(model).items()}
    todo = {
        key: jobs
        for key, jobs in compile_todo(plan, steps, candidates, shared_rows).items()
        if weights.get(key[:3])
    }
    gated = {key: todo[key] for key in gated_projections(model) if key in todo}
    rope = {
        key: (heads, todo[key]) for key, heads in rope_projections(model).items() if key in todo
    }
    tasks = compile_tasks(
        todo, weights, gated, pdl.active(device), rope, frozenset(linear_biases(model))
    )
    return compile_variants(tasks, device, min(8, os.cpu_count() or 1))
