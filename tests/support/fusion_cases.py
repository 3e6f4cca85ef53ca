"""Fused against unfused kernel paths, bit for bit: the GEMV with its SiLU-and-mul prologue
against silu_and_mul followed by the GEMV, the gated GEMV (SiLU-and-mul as the gate/up
projection's epilogue) against the plain GEMV then silu_and_mul, the split-K second pass
fused with the residual add and RMSNorm against the separate pass and add + RMSNorm kernel,
and a tiny Llama's steps with use_triton_ops(fuse=True) against fuse=False. Shared by the
interpreter run (tests/kernels/test_fusion.py, CPU) and the GPU tests
(tests/kernels/test_pdl_gpu.py)."""

from __future__ import annotations

import torch

from tests.support.triton_cases import rel_err


def _rand(gen, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def silu_gemv_case(cfg, rows: int, n: int, k: int, dtype, device, bias=False, seed=0) -> dict:
    """{"equal": fused == silu_and_mul + gemv bitwise, "err": relative error of the fused
    result against a float64 reference of the unfused arithmetic}."""
    from specserve.kernels.gemv import gemv
    from specserve.layers.triton_ops import silu_and_mul

    gen = torch.Generator().manual_seed(seed)
    gate_up = _rand(gen, rows, 2 * k, dtype=dtype, device=device, scale=2.0)
    w = _rand(gen, n, k, dtype=dtype, device=device, scale=k**-0.5)
    b = _rand(gen, n, dtype=dtype, device=device) if bias else None
    act = silu_and_mul(gate_up[:, :k], gate_up[:, k:])
    unfused = gemv(act, w, b, cfg)
    fused = gemv(gate_up, w, b, cfg, silu=True)
    ref = act.double() @ w.double().T + (b.double() if bias else 0)
    return {"equal": torch.equal(fused, unfused), "err": rel_err(fused, ref)}


def gated_gemv_case(
    cfg, rows: int, n: int, k: int, dtype, device, bias=False, seed=0, half=False
) -> dict:
    """{"equal": the gated GEMV of a [gate; up] weight [2n, k] == the plain GEMV then
    silu_and_mul of its halves bitwise, "err": its relative error against a float64
    reference}. half: the gated GEMV through the tile of half cfg's width (as the MLP runs
    it) against the plain one through cfg."""
    from dataclasses import replace

    from specserve.kernels.gemv import gemv
    from specserve.layers.triton_ops import silu_and_mul

    gen = torch.Generator().manual_seed(seed)
    x = _rand(gen, rows, k, dtype=dtype, device=device)
    w = _rand(gen, 2 * n, k, dtype=dtype, device=device, scale=k**-0.5)
    b = _rand(gen, 2 * n, dtype=dtype, device=device) if bias else None
    plain = gemv(x, w, b, cfg)
    unfused = silu_and_mul(plain[:, :n], plain[:, n:])
    fused = gemv(x, w, b, replace(cfg, block_n=cfg.block_n // 2) if half else cfg, gated=True)
    ref = (x.double() @ w.double().T + (b.double() if bias else 0)).to(dtype).double()
    act = torch.nn.functional.silu(ref[:, :n]).to(dtype).double()  # rounded as F.silu
    ref = act * ref[:, n:]
    return {"equal": torch.equal(fused, unfused), "err": rel_err(fused, ref)}


def rope_gemv_case(
    cfg,
    rows: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    k: int,
    dtype,
    device,
    bias=False,
    seed=0,
    page_size=4,
) -> dict:
    """{"equal": the qkv GEMV with the rope epilogue == the plain GEMV then rotary_store_kv,
    bit for bit in q and in both caches (whose other slots keep their contents; one row's
    slot is -1, not stored), "err": q's relative error against the torch rotary of a
    float64 product, "stored": the cache slots the rows wrote}."""
    from specserve.kernels.gemv import RopeStore, gemv
    from specserve.kernels.triton_rotary import rotary_store_kv
    from specserve.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(seed)
    n = (q_heads + 2 * kv_heads) * head_dim
    x = _rand(gen, rows, k, dtype=dtype, device=device)
    w = _rand(gen, n, k, dtype=dtype, device=device, scale=k**-0.5)
    b = _rand(gen, n, dtype=dtype, device=device) if bias else None
    rope = RotaryEmbedding(head_dim, 10000.0, 64)
    rope.materialize(torch.device(device))
    positions = torch.randint(64, (rows,), generator=gen).to(device)
    pages = -(-(rows + 1) // page_size)
    slots = torch.randperm(pages * page_size, generator=gen)[:rows].to(device)
    slots[rows // 2] = -1
    cache = _rand(gen, 2, pages, page_size, kv_heads, head_dim, dtype=dtype, device=device)
    caches = {name: cache.clone() for name in ("fused", "unfused")}
    plain = gemv(x, w, b, cfg)
    q_unfused = rotary_store_kv(
        positions,
        plain,
        rope.cos_sin,
        q_heads,
        kv_heads,
        caches["unfused"][0],
        caches["unfused"][1],
        slots,
    )
    store = RopeStore(
        positions, slots, rope.cos_sin, q_heads, kv_heads, caches["fused"][0], caches["fused"][1]
    )
    q_fused = gemv(x, w, b, cfg, rope=store)
    ref = (x.double() @ w.double().T + (b.double() if bias else 0)).to(dtype)
    q_ref, _ = rope(
        positions,
        ref[:, : q_heads * head_dim].view(rows, q_heads, head_dim),
        ref[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim),
    )
    written = (caches["fused"] != cache).flatten(3).any(-1).any(0).flatten()  # [slots]
    same_caches = torch.equal(caches["fused"], caches["unfused"])
    return {
        "equal": torch.equal(q_fused, q_unfused) and same_caches,
        "err": rel_err(q_fused, q_ref.double()),
        "stored": sorted(torch.nonzero(written).flatten().tolist())
        == sorted(s for s in slots.tolist() if s >= 0),
    }


def split_norm_case(
    cfg, rows: int, n: int, k: int, dtype, device, bias=False, silu=False, seed=0
) -> dict:
    """A split-K GEMV handed unreduced to the fused second pass + residual add + RMSNorm,
    against the GEMV reduced by its own pass, then the add + RMSNorm kernel: whether the
    GEMV output, the residual stream and the normed output are each bitwise equal."""
    from specserve.kernels.gemv import SplitKSum, gemv
    from specserve.layers.triton_ops import add_rms_norm, split_k_add_rms_norm

    gen = torch.Generator().manual_seed(seed)
    x = _rand(gen, rows, 2 * k if silu else k, dtype=dtype, device=device)
    w = _rand(gen, n, k, dtype=dtype, device=device, scale=k**-0.5)
    b = _rand(gen, n, dtype=dtype, device=device) if bias else None
    residual = _rand(gen, rows, n, dtype=dtype, device=device)
    norm_w = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype=dtype, device=device)
    deferred = gemv(x, w, b, cfg, silu=silu, defer_reduce=True)
    if not isinstance(deferred, SplitKSum):
        return {"deferred": False}
    total, normed = split_k_add_rms_norm(deferred, residual, norm_w, 1e-5)
    y = gemv(x, w, b, cfg, silu=silu)
    ref_total, ref_normed = add_rms_norm(y, residual, norm_w, 1e-5)
    return {
        "deferred": True,
        "out": torch.equal(deferred.out, y),
        "total": torch.equal(total, ref_total),
        "normed": torch.equal(normed, ref_normed),
        "reduce": torch.equal(deferred.reduce(), y),  # the pass alone, from the same sums
    }


def set_fusions(model, silu: bool, split_k: bool, gate: bool = True) -> None:
    """Turn the merged MLPs' fusions on or off one by one (use_triton_ops sets all)."""
    from specserve.layers.triton_ops import TritonMergedGatedMLP

    for module in model.modules():
        if isinstance(module, TritonMergedGatedMLP):
            module.fuse_silu, module.fuse_split_k, module.fuse_gate = silu, split_k, gate


def model_fusion_case(
    dtype,
    device,
    config,
    backend=None,
    seed=0,
    cfg=None,
    steps=(1, 3, 8),
    silu=True,
    fused_choice=True,
) -> dict:
    """A tiny Llama on the Triton path with every linear through `config` (a K split
    engages the fusions), steps of 1, 3 and 8 tokens: {"equal": fuse=True (without the
    SiLU prologue when not `silu`) gives the hidden states, logits and KV of fuse=False bit
    for bit, "err": their error against plain torch modules, "fused_norms": how many
    RMSNorms ran a split-K pass (o_proj's and the down projection's), "silu_gemvs": how many
    GEMVs ran the SiLU prologue, "gated_gemvs": how many ran it as the gate/up epilogue,
    "rope_gemvs": how many qkv GEMVs ran rotary and the K/V store as their epilogue (on the
    Triton attention backend, where the tile fits a head)}.
    Without `fused_choice` the plan has measured the fused down projection slower
    (config_for with a fusion gives None): the MLP runs SiLU-and-mul (in the gate/up GEMV's
    epilogue where `config` does not split K) and the plain choice, whose split still
    reduces in the next norm."""
    from specserve.core.kv_cache import KVCache
    from specserve.kernels import gemv as gemv_module
    from specserve.kernels import triton_norm
    from specserve.layers import triton_ops
    from specserve.layers.attention import TorchAttentionBackend
    from specserve.tuning.gemv_select import GemvPlan, use_gemv
    from tests.support.model_cases import build_meta, tiny_config, tiny_model

    cfg = cfg or tiny_config()
    backend = backend or TorchAttentionBackend()
    model = tiny_model(cfg, dtype, device, seed)
    kv = {name: KVCache(cfg, 9, 4, dtype, device) for name in ("ref", "fused", "unfused")}
    gen = torch.Generator().manual_seed(seed)
    plan = GemvPlan(row_buckets=(1, 2, 4, 8), default=config)
    if not fused_choice:
        plain_choice = plan.config_for
        plan.config_for = lambda rows, n, k, dt, fusion=None: (
            None if fusion else plain_choice(rows, n, k, dt)
        )
    calls = {"fused_norms": 0, "silu_gemvs": 0, "gated_gemvs": 0, "rope_gemvs": 0}
    fused_norm, gemv = triton_ops.split_k_add_rms_norm, triton_ops.gemv

    def counting_norm(*args):
        calls["fused_norms"] += 1
        return fused_norm(*args)

    def counting_gemv(*args, silu=False, gated=False, rope=None, **kwargs):
        calls["silu_gemvs"] += silu
        calls["gated_gemvs"] += gated
        calls["rope_gemvs"] += rope is not None
        return gemv(*args, silu=silu, gated=gated, rope=rope, **kwargs)

    triton_ops.split_k_add_rms_norm, triton_ops.gemv = counting_norm, counting_gemv
    gemv_module.gemv = counting_gemv  # the attention block's qkv GEMV (rope epilogue)
    equal, err, start = True, 0.0, 0
    try:
        with torch.inference_mode():
            for q in steps:
                meta = build_meta([[1, 2, 3, 4]], [start], [start + q], 4, device)
                start += q
                ids = torch.randint(cfg.vocab_size, (q,), generator=gen).to(device)
                triton_ops.use_triton_ops(model, enable=False)
                use_gemv(model, enable=False)
                ref = model.compute_logits(model(ids, meta, kv["ref"].layers, backend)[0])
                use_gemv(model, plan=plan)
                outs = {}
                for name in ("unfused", "fused"):
                    triton_ops.use_triton_ops(model, fuse=name == "fused")
                    if name == "fused" and not silu:
                        set_fusions(model, silu=False, split_k=True)
                    hidden, _ = model(ids, meta, kv[name].layers, backend)
                    outs[name] = (hidden, model.compute_logits(hidden))
                equal &= all(torch.equal(a, b) for a, b in zip(outs["fused"], outs["unfused"]))
                err = max(err, rel_err(outs["fused"][1], ref))
        for (kf, vf), (ku, vu) in zip(kv["fused"].layers, kv["unfused"].layers):
            equal &= torch.equal(kf, ku) and torch.equal(vf, vu)
    finally:
        triton_ops.split_k_add_rms_norm, triton_ops.gemv = fused_norm, gemv
        gemv_module.gemv = gemv
        assert triton_norm.split_k_add_rms_norm is fused_norm
    return {"equal": bool(equal), "err": err, **calls}
