"""Verify tiles (tuning/verify_tiles.py, GemvPlan.verify): on the CPU, the plan's lookup
(a verify step of up to 16 requests at 32 or 64 rows takes its verify tile, every other
step the shared choice; whole-step tuning of a shared choice drops the verify tiles matched
to it), the candidates, the verify steps of an engine's graph buckets, and the search with
a fake step output and timer (a candidate with other bits never kept, a faster one with the
same bits kept past the margin, twice); on a GPU, the search on a real model whose shared
tile is forced, and every row of its verify steps against the same row alone."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels.gemv_configs import GemvConfig, verify_candidates
from specserve.kernels.gemv_plan import GemvChoice, GemvPlan
from specserve.tuning.verify_tiles import compile_todo, tune_verify_tiles, verify_steps

S, A, B, C = (
    GemvConfig(32, 256, num_stages=4),
    GemvConfig(64, 128, num_stages=4),
    GemvConfig(128, 128),
    GemvConfig(128, 64, num_stages=4),
)
BIG, SMALL = (96, 64, torch.float16), (32, 64, torch.float16)  # (N, K, dtype)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _plan() -> GemvPlan:
    keys = [(b, *shape) for b in BUCKETS for shape in (BIG, SMALL)]
    return GemvPlan(
        {k: GemvChoice(S if k[0] <= 16 else C, 10.0, 9.0, 3) for k in keys}, row_buckets=BUCKETS
    )


def test_a_verify_step_of_up_to_16_requests_takes_its_verify_tile_and_nothing_else_does():
    plan = _plan()
    plan.verify[(64, *BIG)] = A
    plan.step_requests = 16
    assert plan.config_for(64, *BIG) == A  # verify: 16 requests x 4 tokens
    assert plan.config_for(33, *BIG) == A  # (rows round up to the 64 bucket)
    assert plan.config_for(32, *BIG) == S  # no verify tile at 32 rows: the shared tile
    assert plan.config_for(16, *BIG) == S and plan.config_for(64, *SMALL) == S
    plan.step_requests = 64  # past the shared request counts: the row bucket's own choice
    assert plan.config_for(64, *BIG) == C
    plan.step_requests, plan.by_requests = 16, False  # --disable-batch-invariance
    assert plan.config_for(64, *BIG) == C


def test_tuning_a_shared_choice_drops_the_verify_tiles_matched_to_it():
    plan = _plan()
    plan.verify = {(64, *BIG): A, (32, *BIG): A, (64, *SMALL): B}
    plan.set_config([(b, *BIG) for b in (1, 2, 4, 8, 16)], B)
    assert plan.verify == {(64, *SMALL): B}
    plan.set_config([(64, *SMALL)], A)  # a bucket of its own: verify tiles stay
    assert plan.verify == {(64, *SMALL): B}


def test_candidates_are_16_row_tiles_with_the_shared_split():
    shared = GemvConfig(32, 128, split_k=3, num_warps=2, num_stages=4)
    for rows in (32, 64):
        cands = verify_candidates(shared, rows, 4096, 14336, 132)
        assert cands and shared not in cands and len(set(cands)) == len(cands)
        assert all(c.block_m == 16 and c.split_k == 3 and c.use_dot and not c.tma for c in cands)
    plain = verify_candidates(S, 64, 6144, 4096, 132)
    assert plain and all(c.split_k == 1 for c in plain)
    assert any(c.block_n >= 128 for c in plain)  # the wide tiles of 64 rows among them


def test_verify_steps_are_the_largest_batch_of_up_to_16_requests_per_row_bucket():
    plan = _plan()
    assert verify_steps(plan, (1, 2, 4, 8, 16, 32, 48, 64), 4, 16) == {32: (8, 4), 64: (16, 4)}
    assert verify_steps(plan, (1, 2, 4, 8, 16), 2, 16) == {32: (16, 2)}
    assert verify_steps(plan, (1, 2, 4), 4, 16) == {}  # every verify step within 16 rows


def test_what_the_search_may_run_is_compiled_first_per_projection_with_a_triton_tile():
    plan = _plan()
    plan.set_config([(b, *SMALL) for b in (1, 2, 4, 8, 16)], None)  # cuBLAS: nothing to try
    todo = compile_todo(
        plan, {64: (16, 4), 32: (8, 4)}, lambda shared, rows, key: [A, B] if rows == 64 else [C], 16
    )
    assert todo == {BIG: [(32, [S, C]), (64, [S, A, B])]}


class Fakes:
    """Step output and time from the plan as it stands: `other` tiles change the output's
    bits; a step costs the sum over shapes of its 64-row choice's cost (100 unlisted)."""

    def __init__(self, plan, cost, other=()):
        self.plan, self.cost, self.other = plan, cost, set(other)
        self.outputs = self.timings = 0

    def output(self, batch, q):
        self.outputs += 1
        self.plan.step_requests = batch
        cfgs = [self.plan.config_for(batch * q, *shape) for shape in (BIG, SMALL)]
        self.plan.step_requests = None
        return (torch.tensor([float(c in self.other) for c in cfgs]),)

    def timer(self, batch, q):
        self.timings += 1
        self.plan.step_requests = batch
        t = sum(
            self.cost.get((shape, self.plan.config_for(batch * q, *shape)), 100.0)
            for shape in (BIG, SMALL)
        )
        self.plan.step_requests = None
        return t


def test_search_keeps_a_faster_tile_with_the_same_bits_and_never_one_with_other_bits():
    plan = _plan()
    # BIG: A fastest but other bits, B faster than S (kept), C faster still by 0.1% of the
    # step (inside the margin); SMALL: nothing beats S
    cost = {
        (BIG, S): 20.0,
        (BIG, A): 1.0,
        (BIG, B): 10.0,
        (BIG, C): 9.99,
        (SMALL, S): 5.0,
        (SMALL, A): 6.0,
        (SMALL, B): 7.0,
    }
    fakes = Fakes(plan, cost, other={A})
    report = tune_verify_tiles(
        plan, {64: (16, 4)}, lambda shared, rows, key: [A, B, C], fakes.timer, fakes.output, 16
    )
    assert plan.verify == {(64, *BIG): B}
    assert report.changes == [((64, *BIG), str(S), str(B))]
    assert ((64, *BIG), str(A)) in report.rejected and ((64, *SMALL), str(A)) in report.rejected
    assert report.steps_ms["16x4"] == (25.0, 15.0)
    assert fakes.outputs == 1 + 2 * 3  # the reference, then each candidate's bits
    # decode steps and a 32-row verify step keep the shared tile
    plan.step_requests = 16
    assert plan.config_for(16, *BIG) == S and plan.config_for(64, *BIG) == B
    plan.step_requests = 8
    assert plan.config_for(32, *BIG) == S


def test_search_skips_torch_shared_choices_and_candidates_that_fail():
    plan = _plan()
    plan.set_config([(b, *SMALL) for b in (1, 2, 4, 8, 16)], None)  # cuBLAS serves SMALL

    def candidates(shared, rows, key):
        assert shared == S and key[1:] == BIG  # never asked for a torch choice
        return [A, B]

    fakes = Fakes(plan, {(BIG, S): 20.0, (BIG, B): 10.0})

    def output(batch, q):
        plan.step_requests = batch
        failing = plan.config_for(batch * q, *BIG) == A
        plan.step_requests = None
        if failing:
            raise RuntimeError("out of resources")
        return (torch.zeros(1),)

    report = tune_verify_tiles(plan, {64: (16, 4)}, candidates, fakes.timer, output, 16)
    assert plan.verify == {(64, *BIG): B} and report.rejected == [((64, *BIG), str(A))]


@pytest.mark.gpu
def test_gpu_verify_tiles_give_verify_rows_their_decode_bits(tiny_llama):
    """An engine whose shared GEMV choices are all one Triton tile searches the verify tiles
    of its K=3 verify steps (8 and 16 requests: 32 and 64 rows) with the real step output
    and a timer that favours every candidate, so each one with the step's bits is kept; then
    every row of its verify steps (20-64 rows) has the bits of the same row alone."""
    from specserve.core.config import EngineConfig
    from specserve.engine.engine import LLMEngine
    from specserve.kernels.gemv_configs import verify_candidates as cands
    from specserve.tuning.gemv_select import SHARED_ROWS
    from specserve.tuning.plan_tuning import StepTimer
    from specserve.tuning.verify_tiles import StepOutput
    from tests.tuning.test_plan_tuning import rows_apart

    config = EngineConfig.from_flags(
        model=str(tiny_llama),
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=SHARED_ROWS,
        speculative_algorithm="ngram",
        speculative_num_steps=3,
        disable_verify_tiles=True,
    )
    engine = LLMEngine(config)
    assert engine.verify_tiles is None
    model, graphs = engine.runner.model, engine.runner.graphs
    plan = model.gemv_plan
    shared = GemvConfig(16, 64, num_warps=2, num_stages=3)
    for key in [k for k in plan.choices if k[0] <= SHARED_ROWS]:
        plan.set_config([key], shared)
    steps = verify_steps(plan, graphs.batch_buckets, 4, SHARED_ROWS)
    assert set(steps) == {32, 64}
    report = tune_verify_tiles(
        plan,
        steps,
        lambda s, rows, key: cands(s, rows, key[1], key[2], 132),
        lambda b, q: 10.0 - len(plan.verify),
        StepOutput(graphs, 64),
        SHARED_ROWS,
        keys_used=StepTimer(graphs, 64, 1).keys_used,
    )
    # (no kept tile: on this device no other tile gives the shared tile's bits, and verify
    # tiles change nothing)
    assert report.changes, report.rejected
    assert {k for k, *_ in report.changes} == set(plan.verify)
    apart = rows_apart(model)
    del engine
    assert not apart, apart
