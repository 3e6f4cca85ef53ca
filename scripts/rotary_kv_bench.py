"""GPU benchmark of the fused rotary + paged KV write (`triton_ops.rotary_store_kv`) against
the rotary kernel followed by the KV write kernel, at the Llama-3.1-8B attention shape (32
query heads over 8 KV heads of 128, pages of 16 tokens) in bf16 at batch 1 and 64: each
side called once per layer in one CUDA graph, outputs compared bit for bit. Part 3 of
gpu_kernel_bench.py."""

from __future__ import annotations

import torch

from specserve.layers import triton_ops
from specserve.layers.attention import triton_kernels
from specserve.layers.gemv_select import time_in_graph_us
from specserve.layers.rotary import RotaryEmbedding


def randn(*shape, dtype):
    return torch.empty(shape, device="cuda", dtype=dtype).normal_(0, shape[-1] ** -0.5)


@torch.inference_mode()
def rotary_kv_case(dt, batch: int, rope, reps: int, layers: int) -> dict:
    """The 8B attention shape, page size 16: rotary kernel + KV write kernel against the fused
    kernel, each `layers` times in one CUDA graph; outputs compared bit for bit."""
    q_heads, kv_heads, d, page = 32, 8, 128, 16
    qkv = randn(batch, (q_heads + 2 * kv_heads) * d, dtype=dt)
    pos = torch.randint(0, rope.max_positions, (batch,), device="cuda")
    slots = torch.randperm(4096 * page, device="cuda")[:batch] + page
    caches = [randn(4097, page, kv_heads, d, dtype=dt) for _ in range(2)]
    caches += [c.clone() for c in caches]
    q, k, v = qkv.split([q_heads * d, kv_heads * d, kv_heads * d], -1)
    q, k, v = (t.reshape(batch, -1, d) for t in (q, k, v))

    def unfused(_x, _w):
        qr, kr = triton_ops.rotary(pos, q, k, rope.cos_sin)
        triton_kernels.write_kv(kr, v, caches[0], caches[1], slots)
        return qr

    def fused(_x, _w):
        return triton_ops.rotary_store_kv(pos, qkv, rope.cos_sin, q_heads, kv_heads, caches[2],
                                          caches[3], slots)  # fmt: skip

    q_a, q_b = unfused(None, None), fused(None, None)
    torch.cuda.synchronize()
    same = (torch.equal(q_a, q_b) and torch.equal(caches[0], caches[2])
            and torch.equal(caches[1], caches[3]))  # fmt: skip
    us = {name: time_in_graph_us(fn, None, [None] * layers, reps)
          for name, fn in (("unfused", unfused), ("fused", fused))}  # fmt: skip
    return dict(batch=batch, unfused_us=round(us["unfused"], 2), fused_us=round(us["fused"], 2),
                identical=same, per_step_saving_us=round(layers * (us["unfused"] - us["fused"]), 1))


def rotary_kv_bench(reps: int, layers: int = 32) -> list[dict]:
    """Part 3, batch 1 and 64 in bf16."""
    rope = RotaryEmbedding(128, 500000.0, 8192)
    rope.materialize(torch.device("cuda"))
    return [dict(dtype="bf16", **rotary_kv_case(torch.bfloat16, batch, rope, reps, layers))
            for batch in (1, 64)]  # fmt: skip


def markdown(rows: list[dict]) -> list[str]:
    """The part's table, for kernels.md."""
    lines = ["", "| rotary + KV write | batch | unfused us | fused us | identical | "
             "saving per 32-layer step, us |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['batch']} | {r['unfused_us']} | {r['fused_us']} | "
                     f"{r['identical']} | {r['per_step_saving_us']} |")  # fmt: skip
    return lines
