"""Rotary and the K/V store inside the decode attention kernel (`DecodeRope`,
triton_attn.ROPE_IN_ATTENTION) against the rotary + K/V store kernel followed by the decode
attention kernel, on one decode step: the output and the whole cache must be the same bits.
Run through the Triton interpreter by tests/triton_cases.py (case names `rope_in_attention`).
The requests' owners of the new token (the program whose chunk holds it) vary between the
first, a middle and the last program; the interpreter runs a request's programs in order,
so a store by a later program than the owner shows, one by an earlier program only on a GPU
(test_triton_attention.py's GPU test, where they run at once).
"""

from __future__ import annotations

import torch

from tests.triton_cases import make_batch

# (name suffix, kwargs): splits and chunkings the decode kernel takes, a group of three query
# heads (rows padded to the block), pages of one token, fp32 activations
ROPE_CASES = {
    "fp16-page16-split1": dict(ns=1),
    "fp16-page4-split3": dict(ns=3, page_size=4),
    "fp16-page16-chunks4-split2": dict(ns=2, chunk_splits=4),  # fewer programs than chunks
    "fp16-page1-group3-split2": dict(ns=2, page_size=1, group=3),
    "fp32-page16-split2": dict(ns=2, dtype=torch.float32),
}


def rope_in_attention_error(kernels, ops, ns: int, page_size: int = 16, group: int = 2,
                            dtype=torch.float16, chunk_splits: int | None = None,
                            seq_lens=(1, 17, 40, 63), kv_heads: int = 2, head_dim: int = 32,
                            device: str = "cpu") -> float:  # fmt: skip
    """The largest difference between the two paths' outputs and caches (0: the same
    bits); every request decodes one token, after seq_len - 1 cached ones."""
    from specserve.layers.rotary import RotaryEmbedding

    n = len(seq_lens)
    batch = make_batch([1] * n, [s - 1 for s in seq_lens], list(seq_lens), page_size,
                       kv_heads, group, head_dim, dtype, device, seed=7)  # fmt: skip
    m, q_heads = batch.meta, kv_heads * group
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(n, (q_heads + 2 * kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype=dtype, device=device)
    rope = RotaryEmbedding(head_dim, 10000.0, max(seq_lens))
    rope.materialize(torch.device(device))
    scale = head_dim**-0.5
    launch = dict(num_splits=ns, block_n=16, chunk_splits=chunk_splits,
                  min_chunk=16 if chunk_splits else None)  # fmt: skip

    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    q = ops.rotary_store_kv(m.positions, qkv, rope.cos_sin, q_heads, kv_heads, kc, vc,
                            m.slot_mapping)  # fmt: skip
    want = kernels.paged_attention(q, kc, vc, m.positions, m.query_start_loc, m.seq_lens,
                                   m.block_tables, 1, scale, **launch)  # fmt: skip

    fk, fv = batch.k_cache.clone(), batch.v_cache.clone()
    fused = kernels.DecodeRope(qkv, rope.cos_sin, m.slot_mapping, q_heads)
    got = kernels.paged_attention(None, fk, fv, m.positions, m.query_start_loc, m.seq_lens,
                                  m.block_tables, 1, scale, rope=fused, **launch)  # fmt: skip
    return max((a.double() - b.double()).abs().max().item()
               for a, b in ((got, want), (fk, kc), (fv, vc)))  # fmt: skip


def rope_model_error(backend, ops, dtype=torch.float16, page_size=4, seed=0) -> float:
    """A tiny Llama on the Triton ops over a prefill, two decode steps and a verify step,
    with ROPE_IN_ATTENTION on (the decode steps' rotary and K/V store in attention) and
    off: the largest difference between their hidden states and KV caches (0: the same
    bits)."""
    from specserve.engine.kv_cache import KVCache
    from specserve.layers.attention import triton_attn
    from tests.model_cases import _steps, build_meta, tiny_config, tiny_model

    cfg = tiny_config()
    model = tiny_model(cfg, dtype, "cpu", seed)
    ops.use_triton_ops(model)
    prompt_lens, q_after = (6, 4, 3), (1, 1, 3)
    pages = -(-(max(prompt_lens) + sum(q_after)) // page_size)
    kv = [KVCache(cfg, 1 + pages * len(prompt_lens), page_size, dtype, "cpu") for _ in "ab"]
    tables = [kv[0].allocator.allocate(pages) for _ in prompt_lens]
    gen = torch.Generator().manual_seed(seed)
    worst, previous = 0.0, triton_attn.ROPE_IN_ATTENTION
    kernels, launches = backend.kernels, []
    attend = kernels.paged_attention

    def counted(*args, rope=None, **kwargs):  # the steps that took the rope path
        launches.append(rope is not None)
        return attend(*args, rope=rope, **kwargs)

    kernels.paged_attention = counted
    try:
        with torch.inference_mode():
            for starts, ends in _steps(prompt_lens, q_after):
                meta = build_meta(tables, starts, ends, page_size, "cpu")
                ids = torch.randint(cfg.vocab_size, (meta.positions.shape[0],), generator=gen)
                outs = []
                for on, cache in ((False, kv[0]), (True, kv[1])):
                    triton_attn.ROPE_IN_ATTENTION = on
                    outs.append(model(ids, meta, cache.layers, backend)[0])
                worst = max(worst, (outs[0].double() - outs[1].double()).abs().max().item())
    finally:
        triton_attn.ROPE_IN_ATTENTION = previous
        kernels.paged_attention = attend
    if sum(launches) != 2 * cfg.num_layers:  # the two decode steps' layers, flag on
        return float("inf")
    for (ka, va), (kb, vb) in zip(kv[0].layers, kv[1].layers):
        worst = max(worst, (ka.double() - kb.double()).abs().max().item(),
                    (va.double() - vb.double()).abs().max().item())  # fmt: skip
    return worst


def rope_warm_up_error(backend, ops, dtype) -> float:
    """With ROPE_IN_ATTENTION on, the warm-up also compiles the decode kernel's rope variant
    for each chunking (`warm_up_rope`: 4 variants, none while it is off), writing only to
    page 0 (triton_cases.page0_only_error)."""
    from specserve.layers.attention import triton_attn
    from tests.triton_cases import page0_only_error

    def warm(kv) -> int:
        if backend.warm_up_rope(6, kv) != 0:  # off
            return -1
        previous, triton_attn.ROPE_IN_ATTENTION = triton_attn.ROPE_IN_ATTENTION, True
        try:
            return backend.warm_up_rope(6, kv)
        finally:
            triton_attn.ROPE_IN_ATTENTION = previous

    return page0_only_error(dtype, warm, 4)
