"""The pure-PyTorch reference attention over paged KV: runs anywhere, every fast backend is
tested against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.layers.attention.base import AttentionBackend, AttentionMetadata, write_kv


class TorchAttentionBackend(AttentionBackend):
    """Gathers each request's pages into a padded batch and runs one masked SDPA.

    Handles prefill, chunked extend, decode and multi-token verify alike: the mask lets a
    token at position p see key positions <= p that lie within its request's seq_len.
    """

    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        page_size = k_cache.shape[1]
        pages_needed = -(-meta.max_seq_len // page_size)
        tables = meta.block_tables[:, :pages_needed]
        # [B, pages, page_size, kvh, d] -> [B, kvh, L, d]
        keys = k_cache[tables].flatten(1, 2)[:, : meta.max_seq_len].transpose(1, 2)
        values = v_cache[tables].flatten(1, 2)[:, : meta.max_seq_len].transpose(1, 2)
        group = num_heads // keys.shape[1]
        if group > 1:
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)

        # Scatter packed queries into [B, max_q] rows.
        starts = meta.query_start_loc[:-1]
        q_lens = meta.query_start_loc[1:] - starts
        offs = torch.arange(meta.max_query_len, device=q.device)
        valid = offs[None, :] < q_lens[:, None]  # [B, max_q]
        token_idx = (starts[:, None] + offs[None, :]).clamp(max=num_tokens - 1)
        q_pad = q[token_idx].transpose(1, 2)  # [B, h, max_q, d]
        q_pos = meta.positions[token_idx]  # [B, max_q]

        key_pos = torch.arange(meta.max_seq_len, device=q.device)
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
            key_pos[None, None, :] < meta.seq_lens[:, None, None]
        )
        mask |= ~valid[:, :, None] & (key_pos[None, None, :] == 0)  # padding rows: no NaN
        out = F.scaled_dot_product_attention(
            q_pad, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[:, None], scale=scale
        )
        out = out.transpose(1, 2)  # [B, max_q, h, d]
        return out[valid]
