"""GEMV plan and start-up selection on CPU: row buckets and the torch fallback, the module
switch, weight grouping, candidate sets, and the selection (a fake timer) sharing one
implementation over the small row buckets so that decode and verify steps round alike."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from specserve.kernels.gemv_plan import GemvChoice


def test_plan_buckets_rows_and_falls_back_to_torch():
    from specserve.kernels.gemv import GemvConfig
    from specserve.tuning.gemv_select import ROW_BUCKETS, GemvChoice, GemvPlan, GemvSelector

    cfg = GemvConfig(block_n=64, block_k=128, split_k=4)
    choices = {
        (4, 96, 64, torch.float16): GemvChoice(cfg, 10.0, 8.0, 5),
        (1, 96, 64, torch.float16): GemvChoice(None, 10.0, 10.0, 5),
    }
    plan = GemvPlan(choices, row_buckets=(1, 2, 4, 8))
    assert [plan.config_for(r, 96, 64, torch.float16) for r in (3, 4)] == [cfg, cfg]
    assert plan.config_for(1, 96, 64, torch.float16) is None  # torch measured faster
    assert plan.config_for(2, 96, 64, torch.float16) is None  # not measured
    assert plan.config_for(4, 96, 64, torch.bfloat16) is None
    assert plan.config_for(9, 96, 64, torch.float16) is None  # beyond the largest bucket
    assert GemvPlan(default=cfg).config_for(0, 96, 64, torch.float16) is None
    rows = plan.summary()
    assert {r["kernel"] for r in rows} == {"torch", str(cfg)} and rows[1]["speedup"] == 1.25
    x, w = torch.randn(2, 64), torch.randn(96, 64)  # fp32: the plan serves it with torch
    assert torch.equal(plan.linear(x, w), nn.functional.linear(x, w))
    with pytest.raises(ValueError):
        GemvPlan(row_buckets=(1, 128))
    assert GemvSelector(max_rows=5).row_buckets == (1, 2, 4, 8)  # only what steps reach
    assert GemvSelector(max_rows=64).row_buckets == GemvSelector().row_buckets == ROW_BUCKETS
    fma = GemvConfig(block_n=8, block_k=64, use_dot=False)  # serves at most 8 rows
    assert GemvPlan(row_buckets=(1, 64), default=fma).config_for(20, 96, 64, torch.float16) is None


def test_verify_steps_look_up_the_bucket_of_their_request_count():
    """A step of at most SHARED_ROWS requests (`step_requests`, set by the model's forward)
    runs the shared choice of its request count's bucket at any row count the plan serves:
    a verify row rounds as the same request's decode row. Larger steps, and calls outside
    a step, go by rows."""
    from specserve.kernels.gemv import GemvConfig
    from specserve.kernels.gemv_plan import ROW_BUCKETS, GemvPlan
    from specserve.layers.attention import TorchAttentionBackend
    from specserve.tuning.gemv_select import use_gemv
    from tests.support.model_cases import build_meta, tiny_config, tiny_model

    shared, tall = GemvConfig(32, 64), GemvConfig(64, 64, block_m=64)
    key = (96, 64, torch.float16)
    plan = GemvPlan(
        {(b, *key): GemvChoice(shared if b <= 16 else tall, 2.0, 1.0, 3) for b in ROW_BUCKETS}
    )
    assert plan.config_for(32, *key) == tall  # no step: by rows
    for reqs, rows, want in [
        (8, 32, shared),
        (16, 64, shared),
        (1, 4, shared),
        (4, 4, shared),
        (32, 32, tall),
        (17, 64, tall),
        (1, 65, None),
    ]:
        plan.step_requests = reqs
        assert plan.config_for(rows, *key) == want, (reqs, rows)
    plan.by_requests = False  # --disable-batch-invariance: by rows alone
    plan.step_requests = 8
    assert plan.config_for(32, *key) == tall

    from specserve.core.kv_cache import KVCache

    cfg = tiny_config()
    model = tiny_model(cfg, torch.float32, "cpu")
    plan = use_gemv(model, plan=GemvPlan())
    meta = build_meta([[1], [2], [3]], [0, 0, 0], [2, 1, 3], 4, "cpu")  # 3 requests, 6 rows
    with torch.inference_mode():
        model(
            torch.zeros(6, dtype=torch.long),
            meta,
            KVCache(cfg, 4, 4, torch.float32, "cpu").layers,
            TorchAttentionBackend(),
        )
    assert plan.step_requests == 3


def test_small_batch_engines_measure_the_shared_buckets_and_forget_torch_where_it_varies():
    """An engine of at most SHARED_ROWS requests a step looks every call up in a shared
    bucket: only those are measured (the plan still serves up to its largest bucket's rows).
    A shape found to vary with a bias its cached measurement lacked has its shared torch
    choice measured again, all shared buckets together."""
    from specserve.kernels.gemv import GemvConfig
    from specserve.tuning.gemv_select import ROW_BUCKETS, GemvSelector

    assert GemvSelector(max_rows=64, max_requests=16).measured_buckets == (1, 2, 4, 8, 16)
    assert GemvSelector(max_rows=64, max_requests=16).row_buckets == ROW_BUCKETS
    assert GemvSelector(max_rows=64, max_requests=32).measured_buckets == ROW_BUCKETS
    variant = GemvSelector(max_rows=64, max_requests=16, batch_invariant=False)
    assert variant.measured_buckets == ROW_BUCKETS  # looked up by rows: every bucket

    from specserve.tuning.gemv_select import NORM_TIMED

    selector = GemvSelector()
    shape, other = (96, 64, torch.float16), (32, 64, torch.float16)
    normed = (48, 64, torch.float16)  # cached only as timed with the norm after it
    tile = GemvConfig(32, 64)
    for b in ROW_BUCKETS:
        selector.measured[(b, *shape)] = GemvChoice(None if b <= 16 else tile, 1.0, 1.0, 3)
        selector.measured[(b, *other)] = GemvChoice(None, 1.0, 1.0, 3)
        selector.measured[(b, *shape, "norm")] = GemvChoice(None, 1.0, 1.0, 3)
        selector.measured[(b, *normed, NORM_TIMED)] = GemvChoice(None, 1.0, 1.0, 3)
    selector._forget_torch_choices(frozenset({shape, normed}))
    assert [(b, *shape) in selector.measured for b in ROW_BUCKETS] == [False] * 5 + [True] * 2
    assert [(b, *normed, NORM_TIMED) in selector.measured for b in ROW_BUCKETS] == [False] * 5 + [
        True
    ] * 2
    assert all((b, *other) in selector.measured for b in ROW_BUCKETS)
    assert all((b, *shape, "norm") in selector.measured for b in ROW_BUCKETS)  # unfused: kept


def test_use_gemv_switches_modules_and_back_without_touching_weights():
    from specserve.layers.linear import GemvLinear, GemvMergedLinear, MergedLinear
    from specserve.tuning.gemv_select import GemvPlan, GemvSelector, use_gemv
    from tests.support.model_cases import tiny_config, tiny_model

    model = tiny_model(tiny_config(), torch.float32, "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = use_gemv(model, GemvSelector())  # on the CPU: measured nothing, torch everywhere
    assert isinstance(plan, GemvPlan) and plan.choices == {}
    assert model.gemv_plan is plan
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, (GemvLinear, GemvMergedLinear)) for m in linears)
    assert all(m.gemv_plan is plan for m in linears)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, MergedLinear)
    assert model.model.layers[0].self_attn.qkv_proj.shard_rows()  # still a MergedLinear
    x = torch.randn(3, model.config.hidden_size)
    assert torch.equal(model.compute_logits(x), x @ model.lm_head_weight.T)
    use_gemv(model, enable=False)
    assert model.gemv_plan is None
    assert all(
        type(m) in (nn.Linear, MergedLinear) for m in model.modules() if isinstance(m, nn.Linear)
    )
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in after)


def test_gemv_weights_groups_shapes_and_the_tied_logits_projection():
    from specserve.layers.linear import gemv_weights, linear_biases
    from tests.support.model_cases import tiny_config, tiny_model

    cfg = tiny_config(tie_word_embeddings=True)
    model = tiny_model(cfg, torch.float32, "cpu")
    groups = gemv_weights(model)
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h, torch.float32)
    assert len(groups[qkv]) == cfg.num_layers
    assert len(groups[(2 * cfg.intermediate_size, h, torch.float32)]) == cfg.num_layers
    assert groups[(cfg.vocab_size, h, torch.float32)][0] is not None  # the tied embedding
    assert linear_biases(model) == {}
    biased = tiny_model(tiny_config(qkv_bias=True), torch.float32, "cpu")
    ((key, bias),) = linear_biases(biased).items()  # Qwen2's qkv: one bias per shape
    assert key == qkv and bias.shape == (qkv[0],)


def test_candidate_configs_are_the_pruned_winners():
    from specserve.kernels.gemv import candidate_configs

    shapes = ((6144, 4096), (128256, 4096), (576, 576), (4096, 14336), (576, 1536))
    for n, k in shapes:
        for rows in (1, 2, 3, 8, 9, 16, 17, 32, 33, 64):
            cands = candidate_configs(rows, n, k, num_sms=132)
            assert 4 <= len(cands) <= 9 and len(set(cands)) == len(cands)
            assert all(c.supports(rows, n, k) for c in cands)
            assert (not cands[0].use_dot) == (rows <= 2)  # the CUDA-core product first
            bm = 16 if rows <= 16 else 32 if rows <= 32 else 64
            assert all(c.block_m == bm for c in cands if c.use_dot)  # the weight read once
            assert all(-(-k // c.split_k) >= c.block_k for c in cands)
            # splits for a long K, and for a square weight where the row block has one
            assert any(c.split_k > 1 for c in cands) == (k > n or (k == n and bm != 32))
    down = candidate_configs(1, 4096, 14336, num_sms=132)
    assert [str(c) for c in down if c.split_k > 1] == [
        "dot m16 n64 k128 s4 w4 st4",
        "dot m16 n32 k128 s3 w2 st4",
    ]
    down = candidate_configs(64, 4096, 14336, num_sms=132)
    assert [str(c) for c in down if c.split_k > 1] == [
        "dot m64 n64 k128 s4 w4 st4",
        "dot m64 n64 k128 s2 w4 st5",
    ]
    o_proj = candidate_configs(8, 4096, 4096, num_sms=132)
    assert [str(c) for c in o_proj if c.split_k > 1] == ["dot m16 n32 k128 s3 w2 st4"]
    o_proj = candidate_configs(64, 4096, 4096, num_sms=132)
    assert [str(c) for c in o_proj if c.split_k > 1] == ["dot m64 n64 k128 s2 w4 st5"]


def test_small_buckets_time_one_shared_list_without_the_cuda_core_path():
    from specserve.kernels.gemv import candidate_configs
    from specserve.tuning.gemv_select import ROW_BUCKETS, bucket_candidates

    for n, k in ((4096, 4096), (4096, 14336), (576, 576)):
        jobs = dict(bucket_candidates(ROW_BUCKETS, n, k, num_sms=132))
        small = [jobs[b] for b in (1, 2, 4, 8, 16)]
        assert all(c == small[0] for c in small) and len(small[0]) >= 4
        assert all(c.use_dot and c.block_m == 16 for c in small[0])  # one variant per tile
        assert jobs[32] == candidate_configs(32, n, k, 132)
        assert jobs[64] == candidate_configs(64, n, k, 132)


def _fake_selection(monkeypatch, us) -> dict:
    """The selector's choices for one shape [96, 64] with `_measure` replaced by
    `us(config, rows)` (microseconds; config None: torch)."""
    from specserve.tuning.gemv_select import ROW_BUCKETS, GemvSelector, bucket_candidates

    selector = GemvSelector()
    monkeypatch.setattr(selector, "_measure", lambda cfg, x, rotation: (us(cfg, x.shape[0]), 0.0))
    jobs = bucket_candidates(ROW_BUCKETS, 96, 64, num_sms=132)
    selector._measure_shape(96, 64, torch.float16, jobs, [torch.zeros(96, 64)], 1e18)
    return {b: selector.measured[(b, 96, 64, torch.float16)] for b in ROW_BUCKETS}


def test_selection_shares_one_config_over_small_buckets(monkeypatch):
    from specserve.tuning.gemv_select import ROW_BUCKETS, bucket_candidates

    jobs = dict(bucket_candidates(ROW_BUCKETS, 96, 64, num_sms=132))
    a, b = jobs[1][0], jobs[1][1]
    tall = jobs[64][-1]

    def us(cfg, rows):  # a: fastest at one row only; b: fastest summed over 1..16
        if cfg is None:
            return 10.0
        if rows > 16:
            return 5.0 if cfg == tall else 9.0
        return {a: 5.0 if rows == 1 else 9.9, b: 8.0}.get(cfg, 9.5)

    choices = _fake_selection(monkeypatch, us)
    assert choices[1].config == b
    assert all(choices[r].config is choices[1].config for r in (2, 4, 8, 16))  # one object
    assert choices[1].best_us == 8.0 and choices[1].torch_us == 10.0
    assert choices[64].config == tall and choices[32].config == jobs[32][0]  # per bucket
    assert all(c.tried == 1 + len(jobs[r]) for r, c in choices.items())


def test_selection_keeps_torch_unless_a_config_wins_over_the_small_buckets(monkeypatch):
    from specserve.tuning.gemv_select import ROW_BUCKETS, GemvPlan, bucket_candidates

    a = bucket_candidates((4,), 96, 64, num_sms=132)[0][1][0]

    def us(cfg, rows):  # a wins by far at 4 rows, loses everywhere else; 64 rows: any config
        if cfg is None:
            return 10.0
        if rows == 64:
            return 7.0
        return 2.0 if (cfg == a and rows == 4) else 12.0

    choices = _fake_selection(monkeypatch, us)
    assert all(choices[r].config is None for r in (1, 2, 4, 8, 16, 32))
    assert choices[4].best_us == choices[4].torch_us == 10.0
    assert choices[64].config is not None  # the larger buckets choose on their own
    plan = GemvPlan({(r, 96, 64, torch.float16): c for r, c in choices.items()}, ROW_BUCKETS)
    assert {plan.config_for(r, 96, 64, torch.float16) for r in range(1, 33)} == {None}


def test_selection_leaves_torch_out_of_small_buckets_where_it_is_batch_variant(monkeypatch):
    """Where cuBLAS rounds a row differently at different row counts, the small buckets take
    the configuration fastest summed over them even though torch is faster; the larger
    buckets still choose torch where it wins. Tuning's candidates follow the same rule."""
    from specserve.tuning import gemv_select
    from specserve.tuning.gemv_select import (
        ROW_BUCKETS,
        GemvSelector,
        bucket_candidates,
        plan_candidates,
    )

    jobs = bucket_candidates(ROW_BUCKETS, 96, 64, num_sms=132)
    a, b = dict(jobs)[1][:2]

    def us(cfg, rows):  # torch fastest everywhere; b the faster configuration over 1..16
        return 5.0 if cfg is None else (8.0 if cfg == b else 9.0)

    def select(torch_shared, deadline=1e18) -> dict:
        selector = GemvSelector()
        monkeypatch.setattr(
            selector, "_measure", lambda cfg, x, rotation: (us(cfg, x.shape[0]), 0.0)
        )
        selector._measure_shape(
            96, 64, torch.float16, jobs, [torch.zeros(96, 64)], deadline, torch_shared=torch_shared
        )
        return {r: selector.measured[(r, 96, 64, torch.float16)] for r in ROW_BUCKETS}

    for torch_shared in (True, False):
        got = select(torch_shared)
        small = {got[r].config for r in (1, 2, 4, 8, 16)}
        assert small == ({None} if torch_shared else {b})
        assert got[1].torch_us == 5.0 and got[1].best_us == (5.0 if torch_shared else 8.0)
        assert got[32].config is None and got[64].config is None
    # the measuring budget spent before the shape: its first configuration still runs in
    # every small bucket, and serves them
    got = select(False, deadline=0.0)
    assert {got[r].config for r in (1, 2, 4, 8, 16)} == {a} and got[64].config is None

    varies = frozenset({(96, 64, torch.float16)})
    candidates = plan_candidates(None, varies, num_sms=132)
    assert candidates((4, 96, 64, torch.float16)) == dict(jobs)[4]  # no None: no torch
    # a fused key's None is its unfused path through the shape's own (Triton) choice: kept
    assert candidates((4, 96, 64, torch.float16, "norm")) == [None, *dict(jobs)[4]]
    assert candidates((32, 96, 64, torch.float16)) == [None, *dict(jobs)[32]]
    assert candidates((4, 96, 32, torch.float16))[0] is None  # another shape
    assert gemv_select.choose({1: {None: 1.0, a: math.inf}}, 0.02, False)[1].config is None


def test_torch_rows_agree_compares_each_row_count_with_the_full_batch(monkeypatch):
    """A linear that computes each row on its own agrees at every row count; one whose
    result depends on the row count (as cuBLAS's kernel choice may), or that takes another
    path for one row with a bias (as PyTorch's addmm does), does not. torch_varies checks
    each shape once, with the bias of its layers where they have one."""
    from specserve.kernels.gemv_plan import GemvPlan
    from specserve.tuning import gemv_invariance
    from specserve.tuning.gemv_invariance import torch_rows_agree

    w, bias = torch.randn(24, 32), torch.randn(24)

    def per_row(x, w, b=None):
        return torch.stack([r @ w.T + (0 if b is None else b) for r in x])

    def one_row_apart(x, w, b=None):  # a different path for one row, with a bias only
        return per_row(x, w, b) * (1 + (b is not None and len(x) == 1) * 1e-3)

    assert torch_rows_agree(w, 16, linear=per_row)
    assert torch_rows_agree(w, 16, bias, linear=per_row)

    def by_count(x, w, b=None):  # another kernel from 8 rows on
        return per_row(x, w, b) * (1 + (len(x) >= 8) * 1e-3)

    assert not torch_rows_agree(w, 16, linear=by_count)
    assert torch_rows_agree(w, 16, linear=one_row_apart)
    assert not torch_rows_agree(w, 16, bias, linear=one_row_apart)
    seen = []
    torch_rows_agree(w, 4, linear=lambda x, w, b: seen.append(len(x)) or per_row(x, w))
    assert seen == [4, 1, 2, 3]

    checked = []

    def fake(w, rows, bias=None):
        checked.append((tuple(w.shape), bias is not None, rows))
        return bias is None

    monkeypatch.setattr(gemv_invariance, "torch_rows_agree", fake)
    monkeypatch.setattr(gemv_invariance, "_TORCH_ROWS", {})
    plain, biased = (24, 32, torch.float32), (48, 32, torch.float32)
    weights = {plain: w, biased: torch.randn(48, 32)}
    for _ in range(2):  # the second time from the cache
        assert gemv_invariance.torch_varies(weights, {biased: torch.randn(48)}, 16) == {biased}
    assert sorted(checked) == [((24, 32), False, 16), ((48, 32), True, 16)]
    assert gemv_invariance.torch_varies(weights, {}, 1) == frozenset()  # one row: nothing

    plan = GemvPlan(
        {(1, 24, 32, torch.float32): GemvChoice(None, 1.0, math.inf, 3)},
        torch_varies=frozenset({plain}),
    )
    assert plan.summary()[0]["torch_varies"] is True
    assert plan.summary()[0]["speedup"] is None  # not a finite ratio: no Infinity in JSON


def test_rotation_set_exceeds_the_cache_with_distinct_weights():
    from specserve.tuning.gemv_select import rotation_set

    own = [torch.zeros(10, 10), torch.ones(10, 10)]  # 400 bytes each
    rotation = rotation_set(own, min_bytes=1000)
    assert rotation[:2] == own and len({id(w) for w in rotation}) == 3  # one clone
    assert len(rotation) == 4 and rotation[3] is rotation[0]  # repeated up to min_calls
    assert len(rotation_set(own, min_bytes=10**9, max_calls=7)) == 7


def test_candidates_are_timed_after_a_kernel_that_writes_their_input(monkeypatch):
    """Selection times each call as the model runs it: after a small kernel (the Triton
    RMSNorm, faked here) that writes the input the call then reads, every call, into one
    buffer; with after_producer=False the call reads x itself (calls back to back)."""
    from specserve.kernels import triton_norm
    from specserve.tuning import gemv_select, gemv_timing

    produced = []

    def fake_norm(x, weight, eps, out):
        produced.append(out)
        return out.copy_(2 * x)

    monkeypatch.setattr(triton_norm, "rms_norm", fake_norm)
    seen = []
    run = gemv_timing.after_producer(
        lambda x, w: seen.append(x.clone()) or x @ w.T, torch.ones(1, 4)
    )
    x, w = torch.randn(1, 4), torch.randn(3, 4)
    assert torch.equal(run(x, w), (2 * x) @ w.T) and torch.equal(seen[0], 2 * x)
    run(x, w)
    assert len(produced) == 2 and produced[0] is produced[1]  # one buffer, one norm per call

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    inputs = []
    monkeypatch.setattr(
        gemv_select, "time_in_graph_us", lambda fn, x, ws, reps: (fn(x, ws[0]), 1.0)[1]
    )
    monkeypatch.setattr(gemv_select, "torch_linear", lambda x, w: inputs.append(x.clone()))
    for producer, factor in [(True, 2), (False, 1)]:
        inputs.clear()
        selector = gemv_select.GemvSelector(after_producer=producer)
        assert selector._measure(None, x, [w])[0] == 1.0
        assert len(inputs) == 2 and all(torch.equal(i, factor * x) for i in inputs)


# ---- GPU ------------------------------------------------------------------------------------


def test_first_calls_do_not_count_against_the_budget(monkeypatch):
    """A candidate's first call (module load on a fresh device) extends the deadline by
    what it took: with the deadline already past, torch's round still runs, and its long
    first call leaves time for every candidate; reported as no candidate untried."""
    import time

    from specserve.tuning.gemv_select import ROW_BUCKETS, GemvSelector, bucket_candidates

    for first_call_s, untried in [(3600.0, False), (0.0, True)]:
        selector = GemvSelector()
        monkeypatch.setattr(selector, "_measure", lambda cfg, x, rotation, s=first_call_s: (1.0, s))
        jobs = bucket_candidates(ROW_BUCKETS, 96, 64, num_sms=132)
        selector._measure_shape(
            96, 64, torch.float16, jobs, [torch.zeros(96, 64)], time.perf_counter()
        )
        assert (selector.skipped > 0) == untried
