"""Whole-step GEMV plan tuning (tuning/plan_tuning.py): on the CPU, the coordinate descent
over plan keys with a fake step timer (the fastest candidate kept only past the margin, keys
of shared buckets changed together, largest weight first, the report) and the grouping of an
engine's plan into tuning steps; on a GPU, the step timer on a real graph runner (a captured
step timed, the static buffers back to their padding values)."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels.gemv_configs import GemvConfig
from specserve.kernels.gemv_plan import GemvChoice, GemvPlan
from specserve.tuning import plan_tuning

A, B, C = GemvConfig(32, 256), GemvConfig(64, 128), GemvConfig(128, 128)
BIG, SMALL = (96, 64, torch.float16), (32, 64, torch.float16)  # (N, K, dtype)


def _plan() -> GemvPlan:
    keys = [(b, *shape) for b in (1, 2, 4, 64) for shape in (BIG, SMALL)]
    return GemvPlan({k: GemvChoice(A, 10.0, 9.0, 3) for k in keys}, row_buckets=(1, 2, 4, 64))


class FakeTimer:
    """Step time from the plan as it stands: a cost per (shape, config), 100 unlisted."""

    def __init__(self, plan, cost):
        self.plan, self.cost, self.calls = plan, cost, []

    def __call__(self, batch, q):
        self.calls.append((batch, q))
        return sum(
            self.cost.get((shape, self.plan.config_for(batch, *shape)), 100.0)
            for shape in (BIG, SMALL)
        )


def test_descent_keeps_the_fastest_candidate_past_the_margin_for_every_shared_key():
    plan = _plan()
    # BIG: C is 10% faster than A (kept), B 0.1% (inside the margin); SMALL: torch 5% faster
    cost = {(BIG, A): 10.0, (BIG, B): 9.99, (BIG, C): 9.0, (SMALL, A): 2.0, (SMALL, None): 1.9}
    timer = FakeTimer(plan, cost)
    shared = {"shared": ([(1, 1)], [[(b, *s) for b in (1, 2, 4)] for s in (SMALL, BIG)])}
    report = plan_tuning.tune_plan(plan, shared, lambda key: [None, A, B, C], timer, 0.003)
    assert [plan.config_for(r, *BIG) for r in (1, 2, 3, 4)] == [C] * 4
    assert [plan.config_for(r, *SMALL) for r in (1, 2, 4)] == [None] * 3
    assert plan.config_for(64, *BIG) == A  # not in the tuned group
    assert report.changes == [((1, *BIG), str(A), str(C)), ((1, *SMALL), str(A), "torch")]
    assert report.steps_ms["shared"] == (12.0, 10.9)
    # each winner timed twice more (against the choice it replaces, then itself), the plan
    # after tuning once more
    assert report.evaluations == 1 + (3 + 2) + (3 + 2) + 1 and set(timer.calls) == {(1, 1)}
    assert plan.choices[(2, *BIG)].tuned and not plan.choices[(64, *BIG)].tuned
    assert {r["kernel"] for r in plan.summary() if r.get("tuned")} == {str(C), "torch"}


def test_descent_changes_nothing_when_no_candidate_beats_the_margin():
    plan = _plan()
    timer = FakeTimer(plan, {(BIG, A): 10.0, (BIG, B): 9.98})
    groups = {"shared": ([(1, 1), (1, 4)], [[(1, *BIG), (2, *BIG), (4, *BIG)]])}
    report = plan_tuning.tune_plan(plan, groups, lambda key: [None, A, B], timer, 0.003)
    assert report.changes == [] and plan.config_for(1, *BIG) == A
    assert timer.calls.count((1, 4)) == timer.calls.count((1, 1)) == 4  # both steps summed
    assert not any(c.tuned for c in plan.choices.values())  # tried, put back: not marked


def test_descent_rejects_a_lucky_timing_and_a_candidate_that_fails():
    """A candidate faster only in its first timing is not taken; one that raises counts as
    infinitely slow and leaves the plan as it was."""
    plan = _plan()
    first = {B: True}
    timer = FakeTimer(plan, {(BIG, A): 10.0, (BIG, C): 10.0})

    def flaky(batch, q):
        cfg = plan.config_for(batch, *BIG)
        if cfg is None:
            raise RuntimeError("out of resources")
        if cfg == B:  # fast once, then slow
            fast, first[B] = first[B], False
            return 5.0 if fast else timer(batch, q)
        return timer(batch, q)

    groups = {"shared": ([(1, 1)], [[(1, *BIG), (2, *BIG), (4, *BIG)]])}
    report = plan_tuning.tune_plan(plan, groups, lambda key: [None, B, C], flaky, 0.003)
    assert report.changes == [] and plan.config_for(1, *BIG) == A
    assert report.steps_ms["shared"] == (110.0, 110.0)


def test_engine_plan_groups_shared_buckets_with_decode_and_verify_and_the_largest_alone(
    monkeypatch,
):
    """The buckets up to 16 at batch-1 decode and verify, bucket 64 at batch-64 decode (when
    the runner has that batch), and only keys the steps look up (SMALL is not, at 64)."""
    plan = _plan()
    seen = {}

    def fake_tune(plan_, groups, candidates, timer, margin=0.003):
        seen.update(groups)
        return plan_tuning.TuningReport()

    class Timer:
        def __init__(self, *args):
            pass

        def keys_used(self, steps):
            return {k for k in plan.choices if k[1:] == BIG or k[0] < 64}

    monkeypatch.setattr(plan_tuning, "tune_plan", fake_tune)
    monkeypatch.setattr(plan_tuning, "StepTimer", Timer)

    class Graphs:
        batch_buckets, q_lens = (1, 2, 4, 8, 16, 32, 64), (1, 2, 3, 4)

    plan_tuning.tune_engine_plan(Graphs(), plan, None, shared_rows=16, verify_tokens=4)
    steps, key_sets = seen["shared"]
    assert steps == [(1, 1), (1, 4)]
    assert sorted(map(sorted, key_sets)) == sorted(
        sorted((b, *s) for b in (1, 2, 4)) for s in (BIG, SMALL)
    )
    assert seen["64"] == ([(64, 1)], [[(64, *BIG)]])
    seen.clear()

    class Plain:
        batch_buckets, q_lens = (1, 2, 4), (1,)

    plan_tuning.tune_engine_plan(Plain(), plan, None, shared_rows=16, verify_tokens=1)
    assert list(seen) == ["shared"] and seen["shared"][0] == [(1, 1)]


def test_plan_records_the_keys_it_is_asked_for():
    """A fused projection's key when one was measured, else the plain one."""
    plan = _plan()
    plan.choices[(1, *BIG, "norm")] = GemvChoice(B, 10.0, 9.0, 3)
    plan = GemvPlan(plan.choices, row_buckets=(1, 2, 4, 64))
    plan.asked = set()
    plan.config_for(1, *BIG, fusion="norm")
    plan.config_for(3, *SMALL, fusion="norm")
    plan.config_for(2, *BIG)
    assert plan.asked == {(1, *BIG, "norm"), (4, *SMALL), (2, *BIG)}


def test_step_timer_finds_the_keys_a_step_looks_up_and_restores_the_padding(monkeypatch):
    """On the CPU (the runner's eager path, a plan of torch choices): the keys the decode
    step looks up are the model's projections at that bucket, logits included; the static
    buffers hold their padding values afterwards."""
    from specserve.layers.linear import gemv_weights
    from specserve.tuning.gemv_select import use_gemv
    from tests.runtime.test_cuda_graphs import _runner

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    runner = _runner()
    model = runner.model
    keys = [(b, n, k, dt) for b in (1, 2, 4) for (n, k, dt) in gemv_weights(model)]
    use_gemv(
        model,
        plan=GemvPlan({k: GemvChoice(None, 1.0, 1.0, 1) for k in keys}, row_buckets=(1, 2, 4)),
    )
    runner.logits_head = lambda hidden: model.compute_logits(hidden, fp32=False)
    timer = plan_tuning.StepTimer(runner, context=20, reps=1)
    used = timer.keys_used([(1, 1), (4, 1), (4, 4)])  # 16 rows: past the plan, torch
    assert used == {k for k in keys if k[0] in (1, 4)} and model.gemv_plan.asked is None
    assert int(runner.seq_lens.min()) == int(runner.seq_lens.max()) == 1
    for buf in (runner.positions, runner.slot_mapping, runner.block_tables):
        assert not buf.any()


@pytest.mark.gpu
def test_gpu_engine_tunes_its_plan_unless_told_not_to(tiny_llama):
    """An engine on the GPU reports its tuning (steps timed, the time before and after per
    group); with disable_gemv_tuning it keeps selection's plan and reports none."""
    from specserve.core.config import EngineConfig
    from specserve.engine.engine import LLMEngine

    for off in (False, True):
        engine = LLMEngine(
            EngineConfig.from_flags(
                model=str(tiny_llama),
                device="cuda",
                dtype="bfloat16",
                max_num_seqs=4,
                disable_gemv_tuning=off,
            )
        )
        report = engine.plan_tuning
        if off:
            assert report is None
            assert not any(c.get("tuned") for c in engine.runner.model.gemv_plan.summary())
        else:
            assert report.evaluations > 1 and "shared" in report.steps_ms
        del engine


@pytest.mark.gpu
def test_gpu_engine_plan_gives_a_row_the_same_bits_at_every_shared_row_count(tiny_llama):
    """Batch invariance (gemv_select.py): whatever selection and whole-step tuning chose for
    the row buckets up to SHARED_ROWS (torch or a Triton tile), a row's projections give the
    same bits alone, as in a batch-1 decode step, as in decode steps of 4 and 16 requests
    and in verify steps of 1, 4 and 16 requests at K=3 (4 to 64 rows, looked up by request
    count: GemvPlan.step_requests) and a step with a prefill chunk, every row of them against
    that row alone (`rows_apart`). The engine speculates (n-gram, K=3), so its plan reaches
    64 rows, its cuBLAS check covers them, and it searches verify tiles for them
    (tuning/verify_tiles.py)."""
    from specserve.core.config import EngineConfig
    from specserve.engine.engine import LLMEngine
    from specserve.tuning.gemv_select import SHARED_ROWS

    engine = LLMEngine(
        EngineConfig.from_flags(
            model=str(tiny_llama),
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=SHARED_ROWS,
            speculative_algorithm="ngram",
            speculative_num_steps=3,
        )
    )
    assert engine.runner.model.gemv_plan.max_rows == 4 * SHARED_ROWS  # verify of 16: 64 rows
    apart = rows_apart(engine.runner.model)
    del engine
    assert not apart, (
        f"rows rounded apart (name, requests, rows, rows apart, choice at 1, at rows): {apart}"
    )


def rows_apart(model) -> list[tuple]:
    """Each row of the model's projections (every linear through its plan, each MLP with
    its fusions, its output handed to the next norm or not, attention's output projection
    as the layer calls it, and the logits) computed alone, as in a batch-1 decode step, and
    in decode steps of 4, 5, 8 and 16 requests, verify steps of 1, 4, 5, 8 and 16 requests at
    K=3 (4 to 64 rows, looked up by request count: GemvPlan.step_requests) and a step with a
    prefill
    chunk: (part, requests, rows, rows whose bits differ, choice at 1 row, at rows) for each
    step where some differ."""
    from specserve.kernels.gemv import SplitKSum
    from specserve.layers.linear import GemvLinear, GemvMergedLinear
    from specserve.layers.triton_ops import TritonMergedGatedMLP
    from specserve.model.llama import Attention
    from specserve.tuning.gemv_select import SHARED_ROWS

    plan = model.gemv_plan
    gen = torch.Generator(device="cuda").manual_seed(0)

    def whole(y):  # a K split's sums reduced by their own pass: the norm's bits
        return y.reduce() if isinstance(y, SplitKSum) else y

    def choice(weight, rows) -> str:
        cfg = plan.config_for(rows, *weight.shape, weight.dtype)
        return str(cfg) if cfg is not None else "torch"

    parts = []
    for name, m in model.named_modules():
        if isinstance(m, (GemvLinear, GemvMergedLinear)):
            parts.append((name, m, m.weight))
        elif isinstance(m, TritonMergedGatedMLP):
            w = m.gate_up_proj.weight
            parts.append((name, m, w))
            parts.append((f"{name} (to the norm)", lambda x, m=m: whole(m(x, True)), w))
        elif isinstance(m, Attention):
            parts.append(
                (
                    f"{name} output (to the norm)",
                    lambda x, m=m: whole(m._output(x, True)),
                    m.o_proj.weight,
                )
            )
    parts.append(("logits", model.compute_logits, model.lm_head_weight))
    assert len(parts) > 6
    steps = [(reqs, reqs * q) for reqs in (1, 4, 5, 8, SHARED_ROWS) for q in (1, 4)][1:]
    steps.append((2, 40))  # two requests, one with a 37-token prefill chunk
    apart = []
    with torch.inference_mode():
        for name, fn, weight in parts:
            x = torch.randn(
                plan.max_rows, weight.shape[1], generator=gen, device="cuda", dtype=weight.dtype
            )
            plan.step_requests = 1
            alone = torch.cat([fn(x[i : i + 1]) for i in range(plan.max_rows)])  # row by row
            for reqs, rows in steps:
                plan.step_requests = reqs
                same = (fn(x[:rows]) == alone[:rows]).flatten(1).all(1)
                if not same.all():
                    apart.append(
                        (
                            name,
                            reqs,
                            rows,
                            int((~same).sum()),
                            choice(weight, 1),
                            choice(weight, rows),
                        )
                    )
    plan.step_requests = None
    return apart


@pytest.mark.gpu
def test_gpu_step_timer_times_a_captured_step_and_restores_the_padding():
    from specserve.layers.attention.triton_attn import TritonAttentionBackend
    from tests.runtime.test_cuda_graphs import _runner

    runner = _runner(use_graphs=True, device="cuda", backend=TritonAttentionBackend())
    timer = plan_tuning.StepTimer(runner, context=20, reps=3)
    assert timer(1, 1) > 0 and timer(4, 4) > 0
    assert int(runner.seq_lens.min()) == int(runner.seq_lens.max()) == 1
    for buf in (runner.positions, runner.slot_mapping, runner.block_tables):
        assert not buf.any()
