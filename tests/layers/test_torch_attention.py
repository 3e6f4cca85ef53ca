"""The PyTorch reference attention backend against a per-token dense loop, over decode,
verify, prefill and mixed layouts, grouped-query heads, page sizes; its per-step layout
cache never serves a stale step."""

from __future__ import annotations

import pytest
import torch

from specserve.layers.attention import TorchAttentionBackend
from specserve.layers.attention.base import write_kv
from tests.support.triton_cases import make_batch


def dense(batch, scale: float) -> torch.Tensor:
    """Token by token, head by head: softmax over the key positions the token may see."""
    meta = batch.meta
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    write_kv(batch.k, batch.v, kc, vc, meta.slot_mapping)
    page_size = kc.shape[1]
    group = batch.q.shape[1] // kc.shape[2]
    out = torch.empty_like(batch.q)
    starts = meta.query_start_loc.tolist()
    for b in range(meta.num_requests):
        table, seq_len = meta.block_tables[b].tolist(), int(meta.seq_lens[b])
        slots = [(table[p // page_size], p % page_size) for p in range(seq_len)]
        keys = torch.stack([kc[page, off] for page, off in slots])  # [L, kvh, d]
        values = torch.stack([vc[page, off] for page, off in slots])
        for t in range(starts[b], starts[b + 1]):
            n = min(int(meta.positions[t]) + 1, seq_len)
            for h in range(batch.q.shape[1]):
                scores = keys[:n, h // group] @ batch.q[t, h] * scale
                out[t, h] = scores.softmax(0) @ values[:n, h // group]
    return out


LAYOUTS = {
    # name: (q_lens, last positions, seq_lens)
    "decode": ([1, 1, 1], [4, 17, 0], [5, 18, 1]),
    "verify": ([4, 4], [9, 20], [10, 21]),
    "verify_past_seq_len": ([3, 3], [6, 12], [5, 11]),  # drafts laid past the committed KV
    "prefill": ([7, 12, 3], [6, 11, 2], [7, 12, 3]),
    "chunked_extend": ([5, 1, 8], [19, 7, 8], [20, 8, 9]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("page_size,group", [(1, 1), (4, 3), (16, 2)])
def test_matches_dense_attention(layout, page_size, group):
    q_lens, ends, seq_lens = LAYOUTS[layout]
    batch = make_batch(
        q_lens,
        ends,
        seq_lens,
        page_size,
        kv_heads=2,
        group=group,
        head_dim=8,
        dtype=torch.float32,
        device="cpu",
        seed=len(layout),
    )
    scale = 8**-0.5
    expected = dense(batch, scale)
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    out = TorchAttentionBackend().forward(batch.q, batch.k, batch.v, kc, vc, batch.meta, scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_layout_is_reused_within_a_step_and_rebuilt_for_the_next():
    backend = TorchAttentionBackend()
    first = make_batch([1, 1], [3, 5], [4, 6], 4, 2, 2, 8, torch.float32, "cpu", seed=1)
    second = make_batch([1, 1], [6, 2], [7, 3], 4, 2, 2, 8, torch.float32, "cpu", seed=2)
    scale = 8**-0.5
    for batch in (first, first, second, first):  # two "layers" of one step, then new steps
        kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
        out = backend.forward(batch.q, batch.k, batch.v, kc, vc, batch.meta, scale)
        torch.testing.assert_close(out, dense(batch, scale), rtol=1e-5, atol=1e-5)
    backend.forward(
        first.q, first.k, first.v, first.k_cache.clone(), first.v_cache.clone(), first.meta, scale
    )
    layout = backend._layout
    backend.forward(
        first.q, first.k, first.v, first.k_cache.clone(), first.v_cache.clone(), first.meta, scale
    )
    assert backend._layout is layout
