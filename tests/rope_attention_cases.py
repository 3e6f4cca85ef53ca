"""The decode attention kernel taking qkv rows (`paged_attention(rope=)`: rotary and K/V store
inside it) against the rotary + K/V store kernel followed by the plain decode kernel: the
same output and the same caches, bit for bit. Shared by the CPU interpreter run (`python -m
tests.rope_attention_cases` with TRITON_INTERPRET=1 prints {name: None or what differs} as
JSON; test_triton_attention.py runs it in a subprocess) and the GPU tests, which also
replay both under CUDA graphs. Nothing here imports triton at module level.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch

from tests.triton_cases import Batch, make_batch


@dataclass
class RopeCase:
    """qkv rows [T, (Q + 2 * KV) * D] of a batch (its caches and metadata; its q, k, v are
    not used), the rotary table and the slots (one may be -1: not stored)."""

    batch: Batch
    qkv: torch.Tensor
    cos_sin: torch.Tensor
    slots: torch.Tensor
    q_heads: int


def rope_case(q_lens, ends, seq_lens, page_size, kv_heads, group, head_dim, dtype, device,
              seed: int, unstored: int | None = None) -> RopeCase:  # fmt: skip
    """Requests as in triton_cases.make_batch; token `unstored` gets slot -1."""
    from specserve.layers.rotary import RotaryEmbedding

    batch = make_batch(q_lens, ends, seq_lens, page_size, kv_heads, group, head_dim, dtype,
                       device, seed)  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    q_heads = kv_heads * group
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(sum(q_lens), width, generator=gen, device=device).to(dtype)
    rope = RotaryEmbedding(head_dim, 10000.0, max(ends) + 8)
    rope.materialize(torch.device(device))
    slots = batch.meta.slot_mapping.clone()
    if unstored is not None:
        slots[unstored] = -1
    return RopeCase(batch, qkv, rope.cos_sin, slots, q_heads)


def rope_mismatch(kernels, case: RopeCase, num_splits: int, kernel: str, block_n: int = 16,
                  num_warps: int = 4, num_stages: int = 3) -> str | None:  # fmt: skip
    """None when the fused launch writes the same output and caches as rotary_store_kv +
    paged_attention on copies of the same caches; else what differs."""
    fused, plain = rope_pair(kernels, case, num_splits, kernel, block_n, num_warps, num_stages)
    return compare(fused, plain)


def rope_pair(kernels, case: RopeCase, num_splits, kernel, block_n=16, num_warps=4,
              num_stages=3):  # fmt: skip
    """((out, k_cache, v_cache) of the fused launch, the same of the two-kernel path), each
    on its own copy of the caches; outputs poisoned with NaN first."""
    from specserve.layers.triton_rotary import rotary_store_kv

    m, b = case.batch.meta, case.batch
    kv_heads = b.k_cache.shape[2]
    launch = dict(num_splits=num_splits, kernel=kernel, block_n=block_n, num_warps=num_warps,
                  num_stages=num_stages)  # fmt: skip
    args = (m.positions, m.query_start_loc, m.seq_lens, m.block_tables, m.max_query_len,
            b.k_cache.shape[3] ** -0.5)  # fmt: skip
    results = []
    for fused in (True, False):
        kc, vc = b.k_cache.clone(), b.v_cache.clone()
        out = torch.full((case.qkv.shape[0], case.q_heads, kc.shape[3]), float("nan"),
                         dtype=case.qkv.dtype, device=case.qkv.device)  # fmt: skip
        if fused:
            rope = kernels.Rope(case.cos_sin, case.slots, case.q_heads)
            kernels.paged_attention(case.qkv, kc, vc, *args, out=out, rope=rope, **launch)
        else:
            q = rotary_store_kv(m.positions, case.qkv, case.cos_sin, case.q_heads, kv_heads,
                                kc, vc, case.slots)  # fmt: skip
            kernels.paged_attention(q, kc, vc, *args, out=out, **launch)
        results.append((out, kc, vc))
    return results[0], results[1]


def compare(fused, plain) -> str | None:
    problems = []
    for name, a, b in zip(("output", "k cache", "v cache"), fused, plain):
        if not torch.isfinite(a).all():
            problems.append(f"{name} not finite")
        elif not torch.equal(a, b):
            diff = (a.float() - b.float()).abs()
            problems.append(f"{name}: {int((diff > 0).sum())} differ, max {diff.max().item():.3g}")
    return "; ".join(problems) or None


def graph_mismatches(kernels, dtype, q_len: int, num_splits: int, kernel: str,
                     replays: int = 3, num_requests: int = 2) -> list[str]:  # fmt: skip
    """On CUDA, at Llama-3.1-8B attention shapes (32 query heads over 8 KV heads of 128,
    pages of 16): both paths captured in CUDA graphs over their own copies of one cache,
    then replayed with fresh qkv rows and lengths of 700-830 (one replay with an unstored
    slot); after each replay the outputs and caches must be equal. Returns what differed."""
    from specserve.layers.rotary import RotaryEmbedding
    from specserve.layers.triton_rotary import rotary_store_kv

    dev, kv_heads, q_heads, head_dim, page, max_ctx = "cuda", 8, 32, 128, 16, 840
    gen = torch.Generator().manual_seed(q_len * 100 + num_splits)
    pages_per = -(-max_ctx // page)
    num_pages = 1 + num_requests * pages_per
    cache = torch.randn(2, num_pages, page, kv_heads, head_dim, generator=gen).to(dev, dtype)
    fused_kv, plain_kv = (cache[0].clone(), cache[1].clone()), (cache[0].clone(), cache[1].clone())
    tables_cpu = (torch.randperm(num_pages - 1, generator=gen) + 1)[: num_requests * pages_per]
    tables_cpu = tables_cpu.view(num_requests, pages_per)
    i64 = dict(dtype=torch.int64, device=dev)
    tables = tables_cpu.to(dev)
    n = num_requests * q_len
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.zeros(n, width, dtype=dtype, device=dev)
    positions, slots = torch.zeros(n, **i64), torch.zeros(n, **i64)
    seq_lens, qsl = torch.zeros(num_requests, **i64), torch.arange(num_requests + 1, **i64) * q_len
    rope = RotaryEmbedding(head_dim, 500000.0, max_ctx + 8)
    rope.materialize(torch.device(dev))
    outs = [torch.empty(n, q_heads, head_dim, dtype=dtype, device=dev) for _ in range(2)]
    launch = dict(num_splits=num_splits, kernel=kernel, block_n=32, num_warps=4, num_stages=3)
    scale = head_dim**-0.5

    def fill(step: int) -> None:
        lens = torch.randint(700, max_ctx - 8, (num_requests,), generator=gen)
        pos = (lens[:, None] - q_len + torch.arange(q_len)).flatten()
        rows = torch.arange(num_requests).repeat_interleave(q_len)
        slot = tables_cpu[rows, pos // page] * page + pos % page
        if step == 1:
            slot[-1] = -1  # a padding token: not stored
        for dst, src in ((positions, pos), (slots, slot), (seq_lens, lens)):
            dst.copy_(src)
        qkv.copy_(torch.randn(n, width, generator=gen).to(dtype))

    def fused() -> None:
        kernels.paged_attention(qkv, *fused_kv, positions, qsl, seq_lens, tables, q_len, scale,
                                out=outs[0], rope=kernels.Rope(rope.cos_sin, slots, q_heads),
                                **launch)  # fmt: skip

    def plain() -> None:
        q = rotary_store_kv(positions, qkv, rope.cos_sin, q_heads, kv_heads, *plain_kv, slots)
        kernels.paged_attention(q, *plain_kv, positions, qsl, seq_lens, tables, q_len, scale,
                                out=outs[1], **launch)  # fmt: skip

    fill(0)
    fused(), plain()  # compiled before the capture (both store the same keys)
    torch.cuda.synchronize()
    graphs = []
    for fn in (fused, plain):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graphs.append(graph)
    problems = []
    for step in range(replays):
        fill(step)
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        problem = compare((outs[0], *fused_kv), (outs[1], *plain_kv))
        if problem:
            problems.append(f"replay {step}: {problem}")
    return problems


# ---- the small cases the CPU interpreter runs ---------------------------------------------
GQA4 = dict(kv_heads=2, group=4, head_dim=32)


def interpreter_cases() -> dict[str, tuple]:
    """name -> (requests (q_lens, ends, seq_lens, page_size), unstored token, dtype, kernel,
    split counts); one CPU test each. Every split count 1..5 is run for decode and verify
    with fp16 and the decode kernel, fewer elsewhere (the interpreter's merge kernel is
    slow)."""
    # Decode: four requests of different lengths, token 2's slot -1 (padding). Verify of 4:
    # the first request's new keys (30..33) straddle two chunks from 2 splits on, the
    # second's positions end 3 before its length and token 5's slot is -1, the third
    # verifies 3 tokens.
    decode = ([1] * 4, [0, 16, 39, 70], [1, 17, 40, 71], 16), 2
    verify = ([4, 4, 3], [33, 20, 66], [34, 24, 67], 4), 5
    every = (1, 2, 3, 4, 5)
    plan = {
        ("decode", "float16", "decode"): every, ("decode", "float16", "prefetch"): every,
        ("decode", "float32", "decode"): (1, 2, 5), ("decode", "float32", "prefetch"): (1, 3),
        ("verify", "float16", "decode"): every, ("verify", "float16", "prefetch"): (1, 2, 4),
        ("verify", "float32", "decode"): (2, 3), ("verify", "float32", "prefetch"): (2, 5),
    }  # fmt: skip
    cases = {}
    for (step, dtype, kernel), splits in plan.items():
        requests, unstored = decode if step == "decode" else verify
        cases[f"rope-{step}-{kernel}-{dtype}"] = (requests, unstored, dtype, kernel, splits)
    return cases


def run_case(name: str, spec: tuple, kernels) -> str | None:
    requests, unstored, dtype, kernel, splits = spec
    case = rope_case(*requests, dtype=getattr(torch, dtype), device="cpu", seed=len(name),
                     unstored=unstored, **GQA4)  # fmt: skip
    for ns in splits:
        problem = rope_mismatch(kernels, case, ns, kernel)
        if problem:
            return f"{ns} splits: {problem}"
    return None


def main() -> None:
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from specserve.layers.attention import triton_kernels as kernels

    # The merge kernel unrolls MAX_REDUCE_SPLITS splits, slow in the interpreter; both paths
    # share it (and 8 covers the 5 splits run here), so a smaller unrolling loses nothing.
    kernels.MAX_REDUCE_SPLITS = 8
    results = {}
    for name, spec in interpreter_cases().items():
        try:
            results[name] = run_case(name, spec, kernels)
        except Exception as e:  # reported per case by the test
            results[name] = f"raised {type(e).__name__}: {e}"
    sys.stdout.write("\n" + json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
