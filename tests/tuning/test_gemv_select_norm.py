"""GEMV selection's timing of the projections that hand the residual add + RMSNorm their
output (gemv_select.NORM_AFTER): which shapes, under which cache keys, and the kernels each
timing runs (the GPU-side timing faked)."""

from __future__ import annotations

import torch


def test_plain_keys_of_norm_feeding_shapes_are_timed_with_the_norm(monkeypatch):
    """A shape whose projection hands the residual add + RMSNorm its output (o_proj's
    NORM_FUSION, a down projection's "split_k" fusion) is measured under its plain key tagged
    NORM_TIMED, and timed as the model runs it: torch, then add + norm; a split tile's
    partial sums reduced inside the norm (no reduce kernel of their own); an unsplit tile,
    then add + norm. Its o_proj key is not measured again. Other shapes' plain keys (a
    "silu"-only down projection's too), and every shape's with NORM_AFTER off, are timed
    alone, untagged."""
    from specserve.kernels.gemv import GemvConfig, SplitKSum
    from specserve.layers import triton_ops
    from specserve.tuning import gemv_select, gemv_timing
    from specserve.tuning.gemv_select import NORM_TIMED, job_keys, norm_fed_shapes

    calls = []

    def fake_gemv(x, w, bias, cfg, defer_reduce=False, **kwargs):
        calls.append(("gemv", cfg.split_k, defer_reduce))
        out = torch.zeros(x.shape[0], w.shape[0])
        if cfg.split_k > 1 and defer_reduce:
            return SplitKSum(torch.zeros(cfg.split_k, *out.shape), None, out, out.shape)
        return out  # (a split reduced by its own pass, when not deferred)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(
        gemv_select, "time_in_graph_us", lambda fn, x, ws, reps: (fn(x, ws[0]), 1.0)[1]
    )
    monkeypatch.setattr(gemv_select, "torch_linear", lambda x, w: calls.append("torch"))
    monkeypatch.setattr(gemv_select, "gemv", fake_gemv)
    monkeypatch.setattr(gemv_timing, "gemv", fake_gemv)
    monkeypatch.setattr(triton_ops, "add_rms_norm", lambda *a: calls.append("add+norm"))
    monkeypatch.setattr(
        triton_ops, "split_k_add_rms_norm", lambda *a: calls.append("split pass+add+norm")
    )
    f32 = torch.float32
    down, o, qkv, head_down = (96, 64, f32), (64, 64, f32), (48, 64, f32), (80, 64, f32)
    fused = {down: "silu+split_k", o: "norm", head_down: "silu"}
    shapes = [down, o, qkv, head_down]
    split, unsplit = GemvConfig(32, 32, split_k=2), GemvConfig(32, 64)
    x = torch.randn(4, 64)

    def timed(shape, cfg, *tag) -> list:  # one call's kernels (the eager call, then timed)
        calls.clear()
        selector._measure(cfg, x, [torch.randn(*shape[:2])], *tag)
        half = len(calls) // 2
        assert calls[:half] == calls[half:]
        return calls[:half]

    for on in (True, False):
        monkeypatch.setattr(gemv_select, "NORM_AFTER", on)
        selector = gemv_select.GemvSelector(after_producer=False)
        selector.norm_after = norm_fed_shapes(fused, shapes)
        assert selector.norm_after == ({down, o} if on else set())
        jobs = job_keys(shapes, fused, selector.norm_after)
        if on:
            assert set(jobs) == {
                (*down, NORM_TIMED),
                (*o, NORM_TIMED),
                qkv,
                head_down,
                (*down, "silu+split_k"),
                (*head_down, "silu"),
            }
        else:
            assert set(jobs) == {*shapes, *((*s, f) for s, f in fused.items())}
        for shape in shapes:
            tag = (NORM_TIMED,) if (*shape, NORM_TIMED) in jobs else ()
            with_norm = bool(tag)
            alone = [["torch"], [("gemv", 2, False)], [("gemv", 1, False)]]
            normed = [
                ["add+norm"],
                [("gemv", 2, True), "split pass+add+norm"],
                [("gemv", 1, True), "add+norm"],
            ]
            got = [timed(shape, cfg, *tag) for cfg in (None, split, unsplit)]
            assert got == (normed if with_norm else alone)
