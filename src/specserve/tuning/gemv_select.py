"""Which kernel serves each decode-sized linear: cuBLAS through torch, or the Triton GEMV in
one of its configurations, measured on the device at start-up (`GemvSelector`) and kept in a
`GemvPlan` (gemv_plan.py) that the linear layers consult per call.

Measurements run the way the engine runs: every candidate is captured in a CUDA graph over
enough distinct weights of the shape (the model's own, cloned when they are few) that the L2
cache cannot serve them, and replayed; the per-call time is the median replay over the calls.
Every Triton variant the candidates need is compiled first (gemv_compile.py), on a thread
pool (the compiler spends most of its time outside the GIL), so a cold start pays
compilation about once.

Batch invariance: every row bucket up to `SHARED_ROWS` of a shape gets the same choice (torch,
or one matrix-unit configuration of row block 16), the one fastest summed over those buckets.
Kernels round bf16 differently, so a per-bucket winner would make a batch-1 decode step
(1 row) and a verify step (K+1 rows) compute the same row differently, and greedy speculative
decoding would drift from plain decoding. One such configuration compiles to one variant for
every M <= 16 (M is not specialized on, the K split depends on K alone, rows past M are
zeros), so a row's reduction order does not depend on M. The CUDA-core path (1 or 2 rows, a
variant per row count) cannot serve those buckets and is no longer a candidate. Buckets 32 and
64 keep their own choice: batch-64 steps were never bit-identical to batch 1 (cuBLAS picks
kernels by shape too).

cuBLAS is such a choice only where it keeps that invariance itself (gemv_invariance.py checks
each weight shape, with its bias, once a process); where it does not, the shape's buckets up
to SHARED_ROWS choose among the Triton configurations alone, even when cuBLAS was faster
(`GemvPlan.torch_varies` lists those shapes; whole-step tuning does not offer torch there
either; a fused key's torch choice is the unfused path through the shape's own choice, so it
stays a candidate). `batch_invariant=False` keeps torch a candidate everywhere.

A projection whose output feeds the residual add + RMSNorm unreduced (attention's o_proj,
a merged MLP's down projection with its split-K pass in the norm: `norm_fed_shapes`) is
timed with that norm after it under its plain key too, a K split's second pass inside the
norm as the model runs it (`NORM_AFTER`; such a shape's o_proj key, which timed the same,
is no longer measured): timed alone, a split paid a reduce kernel that the model does not
run and an unsplit tile did not pay the norm kernel it needs, and at 64 rows selection took
the 8B's unsplit down tile in 3 of 10 engine runs, 1.4% slower a step than the split one.
Those choices are cached apart from the same shape's choices
timed alone (`NORM_TIMED`), which a model whose projection of that shape feeds no norm
(an EAGLE-3 head, a model run without fusions) gets; a drafter whose plan shares the
target's selector shares the target's, which the cache hands it when it asks for the same
timing.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch
from torch import nn

from specserve.kernels import pdl
from specserve.kernels.gemv import GemvConfig, candidate_configs, gemv
from specserve.kernels.gemv_configs import stream_k_enabled
from specserve.kernels.gemv_plan import (  # noqa: F401 (SHARED_ROWS: callers import it here)
    ROW_BUCKETS,
    SHARED_ROWS,
    GemvChoice,
    GemvPlan,
    PlanKey,
)
from specserve.layers.linear import (
    NORM_FUSION,
    fused_projections,
    gated_projections,
    gemv_weights,
    install_gemv_plan,
    linear_biases,
    rope_projections,
)
from specserve.tuning import gemv_invariance
from specserve.tuning.gemv_compile import (  # noqa: F401 (compile_tasks: tests import it here)
    compile_tasks,
    compile_variants,
    variant_key,
)
from specserve.tuning.gemv_timing import (  # noqa: F401 (rotation_set: imported from here)
    after_producer,
    down_and_norm,
    fused_input_cols,
    rotation_set,
    time_in_graph_us,
    torch_linear,
)

log = logging.getLogger(__name__)

ShapeKey = tuple[int, int, torch.dtype]  # (N, K, dtype) of a weight [N, K]
GEMV_DTYPES = (torch.float16, torch.bfloat16)
# Plain keys of the shapes that feed a norm are timed with it (the module docstring; a
# bench A/B switches it off: benchmarks/gpu_engine.py --ab-norm-after), and cached under
# the key with this tag
NORM_AFTER = True
NORM_TIMED = "+norm"


def bucket_candidates(buckets: tuple[int, ...], n: int, k: int, num_sms: int) -> list[tuple]:
    """(bucket, configurations to time) for each row bucket of a weight [n, k]: the buckets up
    to SHARED_ROWS all time the same list, the configurations that serve every row count up
    to SHARED_ROWS in one row block of 16 (no CUDA-core path); larger buckets their own."""
    shared = [
        c
        for c in candidate_configs(SHARED_ROWS, n, k, num_sms)
        if c.use_dot and c.block_m == SHARED_ROWS
    ]
    return [
        (b, list(shared) if b <= SHARED_ROWS else candidate_configs(b, n, k, num_sms))
        for b in buckets
    ]


def plan_candidates(
    device: torch.device,
    torch_varies: frozenset[ShapeKey] = frozenset(),
    num_sms: int | None = None,
):
    """candidates(plan key) -> the choices for that key's row bucket, torch first (None),
    then the configurations selection times there (`bucket_candidates`); torch is left out
    of the plain keys' buckets up to SHARED_ROWS of the shapes (N, K, dtype) in
    `torch_varies` (a plan's: cuBLAS changes a row's bits with the row count there)."""
    sms = num_sms or torch.cuda.get_device_properties(device).multi_processor_count

    def candidates(key: tuple) -> list[GemvConfig | None]:
        bucket, n, k, dtype = key[:4]
        ((_, cands),) = bucket_candidates((bucket,), n, k, sms)
        if bucket <= SHARED_ROWS and len(key) == 4 and (n, k, dtype) in torch_varies:
            return list(cands)  # (a fused key's None is the unfused path: kept)
        return [None, *cands]

    return candidates


def choose(
    times: dict[int, dict], margin: float, torch_shared: bool = True
) -> dict[int, GemvChoice]:
    """Each bucket's choice from its measured times ({bucket: {config or None (torch): us}}).
    The buckets up to SHARED_ROWS share one: the configuration measured in all of them with
    the least total time, if that total beats torch's total by `margin`, else torch (so at
    one bucket alone the shared choice may be slower than torch, or than another
    configuration); with `torch_shared` False (cuBLAS is not batch invariant for the shape)
    that configuration whatever torch's time, torch only if no configuration runs. Larger
    buckets: the fastest there, if it beats torch by `margin`."""
    out: dict[int, GemvChoice] = {}
    shared = [b for b in times if b <= SHARED_ROWS]
    if shared:
        total = {
            c: sum(times[b].get(c, math.inf) for b in shared)
            for c in dict.fromkeys(c for b in shared for c in times[b])
        }
        if not torch_shared:
            total[None] = math.inf  # any configuration that runs wins
        cfg = _winner(total, margin)
        if cfg is None and not torch_shared:
            log.warning(
                "no Triton configuration ran in every bucket up to %d rows: cuBLAS "
                "serves them although it rounds rows apart by row count",
                SHARED_ROWS,
            )
        for b in shared:
            out[b] = GemvChoice(cfg, times[b][None], times[b][cfg], len(times[b]))
    for b in times:
        if b > SHARED_ROWS:
            cfg = _winner(times[b], margin)
            out[b] = GemvChoice(cfg, times[b][None], times[b][cfg], len(times[b]))
    return out


def _winner(times: dict, margin: float) -> GemvConfig | None:
    """The fastest configuration of `times` if it beats torch's (key None) by `margin`; ties
    among configurations go to the first in `times` order."""
    best = min((c for c in times if c is not None), key=lambda c: times[c], default=None)
    if best is None or times[best] == math.inf:
        return None
    if times[None] == math.inf or times[best] <= times[None] * (1 - margin):
        return best
    return None


# (device index, row buckets, margin, after_producer, batch_invariant, stream-K candidates on)
# -> the choices measured so far in this process, by plan key (a plain key timed with the
# norm after it tagged NORM_TIMED).
_MEASURED: dict[tuple, dict[PlanKey, GemvChoice]] = {}


def norm_fed_shapes(fused: dict[ShapeKey, str] | None, shapes) -> set[ShapeKey]:
    """The shapes among `shapes` whose plain keys are timed with the residual add + RMSNorm
    after them, while NORM_AFTER: those of projections that hand it their output, a K
    split's partial sums unreduced (`fused`: o_proj's NORM_FUSION, a down projection's
    fusion with "split_k"; not a "silu"-only one, whose MLP reduces its own split)."""
    if not NORM_AFTER:
        return set()
    return {
        s for s, f in (fused or {}).items() if s in shapes and (f == NORM_FUSION or "split_k" in f)
    }


def job_keys(
    shapes, fused: dict[ShapeKey, str] | None, norm_fed: set[ShapeKey]
) -> dict[tuple, ShapeKey]:
    """{what selection measures (its cache key less the bucket): the weight shape}: each
    shape's plain key, tagged NORM_TIMED where timed with the norm (`norm_fed`), and one
    key per fused projection, (N, K, dtype, fusion), except o_proj's NORM_FUSION where the
    plain key is timed with the norm already (the same timing: its plain choice serves)."""
    jobs = {(*s, NORM_TIMED) if s in norm_fed else s: s for s in shapes}
    for s, f in (fused or {}).items():
        if s in shapes and not (f == NORM_FUSION and s in norm_fed):
            jobs[(*s, f)] = s
    return jobs


class GemvSelector:
    """Measures torch (cuBLAS) against the Triton GEMV's candidate configurations for every
    (row bucket, N, K, dtype) of the weights it is given, and returns the plan.

    `max_rows` (or explicit `row_buckets`) limits the buckets measured to those a caller's
    steps can reach: pass the most tokens a captured decode/verify step holds. A
    configuration wins only if it beats torch by `margin` (ties stay on cuBLAS); the buckets
    up to SHARED_ROWS share one choice, by their summed time (`choose`). First every
    Triton variant needed is compiled (`compile_workers` threads; a cold cache's cost, not
    bounded, reported as `compile_s`), then shapes are measured one after the other, each
    within an equal share of what is left of `budget_s`: torch first for every row bucket,
    then each bucket's first configuration, and so on; what the budget leaves untried is
    counted (`skipped`) and logged. Each call is timed after a small kernel that writes its
    input (`after_producer`; False: calls back to back, the rule before), as the model runs
    it. A variant's first call (loading its module onto the device: tens of ms on a fresh
    machine) is part of the cold cache's cost, not of the budget. Keys measured once are
    remembered: a second model (a drafter sharing shapes with its target) given to the same
    selector only measures its new shapes, and so does every later selector of this process
    with the same row buckets, margin and timing on the same device (`_MEASURED`: engines
    started one after another, as tests do, measure once; a different bucket set measures
    afresh, since the shared choice of buckets up to SHARED_ROWS is made over them all
    together). `batch_invariant`: torch serves a shape's buckets up to SHARED_ROWS only
    where it gives a row the same bits at every row count up to the largest bucket (a step
    of up to SHARED_ROWS requests, a verify step or one with a prefill chunk, runs the
    shared choice at any row count: `GemvPlan.step_requests`), checked before measuring
    (gemv_invariance.py; the plan's `torch_varies` lists the shapes where it does not;
    choices cached for a shape before it was found to vary, by a model without its bias,
    are measured again). With `max_requests` at most SHARED_ROWS (an engine whose steps
    never hold more requests) only the shared buckets are measured: every lookup of such
    steps lands there.
    On a CPU the plan is empty: torch everywhere.
    """

    def __init__(
        self,
        row_buckets: tuple[int, ...] = ROW_BUCKETS,
        budget_s: float = 20.0,
        margin: float = 0.02,
        reps: int = 5,
        max_rows: int | None = None,
        compile_workers: int | None = None,
        after_producer: bool = True,
        batch_invariant: bool = True,
        max_requests: int | None = None,
    ):
        buckets = tuple(sorted(row_buckets))
        if max_rows is not None:
            buckets = (
                tuple(b for b in buckets if b < max_rows)
                + tuple(b for b in buckets if b >= max_rows)[:1]
            )
        self.row_buckets = buckets
        self.budget_s, self.margin, self.reps = budget_s, margin, reps
        self.after_producer, self.batch_invariant = after_producer, batch_invariant
        few = batch_invariant and max_requests is not None and max_requests <= SHARED_ROWS
        # the buckets measured: the shared ones alone when every step's lookups land there
        self.measured_buckets = tuple(b for b in buckets if b <= SHARED_ROWS or not few)
        self.compile_workers = compile_workers or min(8, os.cpu_count() or 1)
        self.measured: dict[PlanKey, GemvChoice] = {}  # bound per device in select()
        self.elapsed_s = self.compile_s = 0.0
        self.compiled = 0  # Triton variants compiled by the last select()
        self.skipped = 0  # candidates left untried when the budget ran out
        self.norm_after: set[ShapeKey] = set()  # shapes timed with the norm after them

    @torch.inference_mode()
    def select(
        self,
        weights: dict[ShapeKey, list[torch.Tensor]],
        fused: dict[ShapeKey, str] | None = None,
        gated: set[ShapeKey] | None = None,
        rope: dict[ShapeKey, tuple] | None = None,
        biases: dict[ShapeKey, torch.Tensor] | None = None,
    ) -> GemvPlan:
        """The plan for `weights` (grouped by shape); `fused`: shapes of projections that
        fuse neighbours into the GEMV (linear.fused_projections), with the fusion, timed
        with them too; `gated`: merged gate/up shapes whose MLP may run SiLU-and-mul in the
        GEMV's epilogue (linear.gated_projections), whose gated variants of every candidate
        are compiled with the rest (whole-step tuning and graph capture run them; a shape
        measured before is submitted again, which Triton's cache answers at once); `rope`:
        qkv shapes whose attention may run rotary and the K/V store in the GEMV's epilogue
        (linear.rope_projections, with their heads), whose rope variants are compiled alike;
        `biases`: a bias of each shape whose layers have one (linear.linear_biases): its
        variants compile with a bias, and cuBLAS's batch invariance is checked with it."""
        shapes = {
            key: [w for w in ws if w.stride(-1) == 1]
            for key, ws in weights.items()
            if ws and ws[0].is_cuda and key[2] in GEMV_DTYPES
        }
        shapes = {key: ws for key, ws in shapes.items() if ws}
        if not shapes:
            return GemvPlan({}, self.row_buckets)
        # a fused projection is one more "shape" to measure: (N, K, dtype, fusion)
        self.norm_after = norm_fed_shapes(fused, shapes)
        jobs_of = job_keys(shapes, fused, self.norm_after)
        start = time.perf_counter()
        device = next(iter(shapes.values()))[0].device
        index = torch.device(device).index
        self.measured = _MEASURED.setdefault(
            (
                index,
                self.row_buckets,
                self.margin,
                self.after_producer,
                self.batch_invariant,
                stream_k_enabled(),
            ),
            self.measured,
        )
        biases = {key: b for key, b in (biases or {}).items() if key in shapes}
        torch_varies = frozenset()
        if self.batch_invariant:
            one = {shape: ws[0] for shape, ws in shapes.items()}
            torch_varies = gemv_invariance.torch_varies(one, biases, self.row_buckets[-1])
            self._forget_torch_choices(torch_varies)
        if torch_varies:
            log.info(
                "cuBLAS rounds a row differently at different row counts for %d weight "
                "shapes; Triton serves their buckets up to %d rows: %s",
                len(torch_varies),
                SHARED_ROWS,
                sorted(shape[:2] for shape in torch_varies),
            )
        props = torch.cuda.get_device_properties(device)
        sms = props.multi_processor_count
        todo = {
            key: bucket_candidates(
                tuple(b for b in self.measured_buckets if (b, *key) not in self.measured),
                key[0],
                key[1],
                sms,
            )
            for key in jobs_of
        }
        todo = {key: jobs for key, jobs in todo.items() if jobs}
        gated_jobs = {
            key: bucket_candidates(self.row_buckets, key[0], key[1], sms)
            for key in gated or ()
            if key in shapes
        }
        rope_jobs = {
            key: (heads, bucket_candidates(self.row_buckets, key[0], key[1], sms))
            for key, heads in (rope or {}).items()
            if key in shapes
        }
        tasks = compile_tasks(
            todo, shapes, gated_jobs, pdl.active(device), rope_jobs, frozenset(biases)
        )
        self.compiled = compile_variants(tasks, device, self.compile_workers)
        self.compile_s = time.perf_counter() - start
        self.skipped = 0
        min_bytes = 4 * getattr(props, "L2_cache_size", 64 << 20)
        measure_start = time.perf_counter()
        for i, ((n, k, dtype, *fusion), jobs) in enumerate(todo.items()):
            # Each shape gets an equal share of what is left; its clones live only meanwhile.
            left = self.budget_s - (time.perf_counter() - measure_start)
            # a fused key's torch is the unfused path through the shape's own choice
            torch_shared = fusion not in ([], [NORM_TIMED]) or (n, k, dtype) not in torch_varies
            self._measure_shape(
                n,
                k,
                dtype,
                jobs,
                rotation_set(shapes[(n, k, dtype)], min_bytes),
                time.perf_counter() + left / (len(todo) - i),
                *fusion,
                torch_shared=torch_shared,
            )
        choices = {
            (b, *[p for p in key if p != NORM_TIMED]): self.measured[(b, *key)]
            for key in jobs_of
            for b in self.measured_buckets
        }
        plan = GemvPlan(
            choices, self.row_buckets, torch_varies=torch_varies, by_requests=self.batch_invariant
        )
        torch.cuda.empty_cache()
        self.elapsed_s = time.perf_counter() - start
        if self.skipped:
            log.warning(
                "GEMV selection hit its %.1f s measuring budget: %d candidates untried",
                self.budget_s,
                self.skipped,
            )
        won = sum(c.config is not None for c in plan.choices.values())
        log.info(
            "GEMV selection: Triton serves %d of %d decode shapes (%.1f s, %d variants "
            "compiled in %.1f s)",
            won,
            len(plan.choices),
            self.elapsed_s,
            self.compiled,
            self.compile_s,
        )
        return plan

    def _forget_torch_choices(self, torch_varies: frozenset[ShapeKey]) -> None:
        """Drop the shared buckets' cached choices of each plain key whose shape cuBLAS is
        now found to round apart (checked with a bias another model's layers lacked) where
        they chose torch: they are measured again, together (one shared choice)."""
        shared = [b for b in self.row_buckets if b <= SHARED_ROWS]
        for shape in torch_varies:
            for key in (shape, (*shape, NORM_TIMED)):  # timed alone, or with the norm
                if any(
                    c is not None and c.config is None
                    for c in (self.measured.get((b, *key)) for b in shared)
                ):
                    for b in shared:
                        self.measured.pop((b, *key), None)

    def _measure_shape(
        self,
        n: int,
        k: int,
        dtype: torch.dtype,
        jobs,
        rotation,
        deadline: float,
        *fusion: str,
        torch_shared: bool = True,
    ) -> None:
        """Time torch and every candidate per row bucket (with a `fusion`: as the fused
        projection and the norm after it; NORM_TIMED: the plain projection and the norm
        after it); record each bucket's choice (`choose`; `torch_shared` False: not torch
        for the buckets up to SHARED_ROWS)."""
        device = rotation[0].device
        cols = fused_input_cols(k, fusion[0]) if fusion and fusion[0] != NORM_TIMED else k
        runs = [
            (b, torch.randn(b, cols, device=device, dtype=dtype), [None, *cands])
            for b, cands in jobs
        ]
        times: dict[int, dict] = {b: {} for b, _, _ in runs}
        for rnd in range(max(len(cands) for _, _, cands in runs)):  # torch first, then...
            for b, x, cands in runs:
                if rnd >= len(cands):
                    continue
                # torch, and where torch may not serve the shared buckets their first
                # configuration, run whatever the budget says: a choice needs a time
                needed = rnd == 0 or (rnd == 1 and not torch_shared and b <= SHARED_ROWS)
                if not needed and time.perf_counter() > deadline:
                    self.skipped += 1
                    continue
                times[b][cands[rnd]], first_call_s = self._measure(cands[rnd], x, rotation, *fusion)
                deadline += first_call_s
        for b, choice in choose(times, self.margin, torch_shared).items():
            self.measured[(b, n, k, dtype, *fusion)] = choice

    def _measure(
        self, cfg: GemvConfig | None, x: torch.Tensor, rotation, *fusion
    ) -> tuple[float, float]:
        """(device time of one call in us, seconds the first, eager call took)."""
        n, k = rotation[0].shape
        if fusion:
            residual = torch.randn(x.shape[0], n, device=x.device, dtype=x.dtype)
            norm_weight = torch.ones(n, device=x.device, dtype=x.dtype)
        if fusion == (NORM_TIMED,):  # a plain key: the projection, then add + RMSNorm
            fn = down_and_norm(cfg, NORM_FUSION, residual, norm_weight)
        elif fusion:  # against what the model runs unfused: the shape's plain choice
            shape = (n, k, x.dtype)
            tag = (NORM_TIMED,) if shape in self.norm_after else ()  # how it was timed
            plain = self.measured.get((x.shape[0], *shape, *tag))
            fn = down_and_norm(
                cfg, fusion[0], residual, norm_weight, plain.config if plain else None
            )
        else:
            fn = torch_linear if cfg is None else (lambda x, w: gemv(x, w, None, cfg))
        if self.after_producer:
            fn = after_producer(fn, x)
        first = time.perf_counter()
        try:
            fn(x, rotation[0])  # load the module if needed, set up cuBLAS
            torch.cuda.synchronize()
        except Exception as e:  # a configuration this device cannot run (shared memory)
            log.debug("GEMV candidate %s failed: %s", cfg, e)
            return float("inf"), time.perf_counter() - first
        first_s = time.perf_counter() - first
        return time_in_graph_us(fn, x, rotation, self.reps), first_s


def use_gemv(
    model: nn.Module,
    selector: GemvSelector | None = None,
    plan: GemvPlan | None = None,
    enable: bool = True,
    max_rows: int | None = None,
) -> GemvPlan | None:
    """Route the model's linear layers (and its logits projection, for models with a
    `gemv_plan` attribute) through a GEMV plan: `plan` when given, else the one `selector`
    (default: GemvSelector(max_rows=max_rows)) measures for the model's weights on their
    device (fused projections timed with their fusions: call use_triton_ops first).
    max_rows: the most tokens a captured decode/verify step holds (None: every row
    bucket up to 64). Call it once the weights are on the device and before CUDA graphs are
    captured; pass one selector for a target and its drafter, so shared shapes are measured
    once. enable=False switches back to plain torch. Returns the plan installed."""
    if enable and plan is None:
        selector = selector or GemvSelector(max_rows=max_rows)
        plan = selector.select(
            gemv_weights(model),
            fused_projections(model),
            gated_projections(model),
            rope_projections(model),
            linear_biases(model),
        )
    install_gemv_plan(model, plan, enable)
    return plan if enable else None
