"""The pure-PyTorch reference attention over paged KV: runs anywhere, every fast backend is
tested against it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.layers.attention.base import AttentionBackend, AttentionMetadata, write_kv


@dataclass
class _StepLayout:
    """What every layer of one step derives from the metadata alike, built once a step."""

    pages: torch.Tensor  # [B * P] page ids covering max_seq_len, row-major by request
    token_idx: torch.Tensor | None  # [B, max_q] packed row of each padded query; None: uniform
    valid: torch.Tensor | None  # [B, max_q] real (not padding) queries; None: uniform
    mask: torch.Tensor  # [B, 1, max_q, L] bool, True where a query may attend


class TorchAttentionBackend(AttentionBackend):
    """Gathers each request's pages into a padded batch and runs one masked SDPA.

    Handles prefill, chunked extend, decode and multi-token verify alike: the mask lets a
    token at position p see key positions <= p that lie within its request's seq_len.
    On the CPU, grouped-query heads go to SDPA as they are (`enable_gqa`), not repeated.
    The padded layout and mask depend only on the step's metadata, so they are built once
    for the first layer and reused by the others. Whole pages are read, so cache slots past
    a request's seq_len must hold finite values (masked out, but 0 * NaN is NaN); the
    engine's pool starts zeroed.
    """

    name = "torch"

    def __init__(self) -> None:
        self._layout_key: tuple | None = None
        self._layout: _StepLayout | None = None

    def _layout_for(self, meta: AttentionMetadata, num_tokens: int, page_size: int):
        # Keyed by object identity (the key holds references, so ids are never reused): a
        # step's metadata is built once and not modified while its layers run.
        key = (
            meta,
            meta.positions,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.max_query_len,
            meta.max_seq_len,
            num_tokens,
            page_size,
        )
        if (
            self._layout_key is not None
            and all(a is b for a, b in zip(key[:5], self._layout_key[:5]))
            and key[5:] == self._layout_key[5:]
        ):
            return self._layout
        self._layout = _build_layout(meta, num_tokens, page_size)
        self._layout_key = key
        return self._layout

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        num_requests, max_q, max_len = meta.num_requests, meta.max_query_len, meta.max_seq_len
        page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        layout = self._layout_for(meta, num_tokens, page_size)

        def gather(cache: torch.Tensor) -> torch.Tensor:
            # [B * P, page_size, kvh, d] -> [B, kvh, L, d]
            pages = cache.index_select(0, layout.pages)
            seq = pages.view(num_requests, -1, kv_heads, head_dim)[:, :max_len]
            return seq.transpose(1, 2).to(q.dtype)

        if layout.token_idx is None:  # every request has max_q tokens: q is already [B, max_q]
            q_pad = q.view(num_requests, max_q, num_heads, head_dim)
        else:
            q_pad = q[layout.token_idx]
        keys, values = gather(k_cache), gather(v_cache)
        group = num_heads // kv_heads
        # CPU SDPA handles grouped heads natively; on CUDA, enable_gqa with a mask would fall
        # back to the math kernel, so repeat the KV heads there instead.
        native_gqa = group > 1 and q.device.type == "cpu"
        if group > 1 and not native_gqa:
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            keys,
            values,
            attn_mask=layout.mask,
            scale=scale,
            enable_gqa=native_gqa,
        )
        out = out.transpose(1, 2)  # [B, max_q, h, d]
        if layout.valid is None:
            return out.reshape(num_tokens, num_heads, head_dim)
        return out[layout.valid]


def _build_layout(meta: AttentionMetadata, num_tokens: int, page_size: int) -> _StepLayout:
    device = meta.positions.device
    num_requests, max_q, max_len = meta.num_requests, meta.max_query_len, meta.max_seq_len
    pages_needed = -(-max_len // page_size)
    pages = meta.block_tables[:, :pages_needed].reshape(-1)
    key_pos = torch.arange(max_len, device=device)
    in_seq = key_pos[None, None, :] < meta.seq_lens[:, None, None]  # [B, 1, L]
    if num_tokens == num_requests * max_q:
        # Query lengths sum to B * max_q and none exceeds max_q: all equal, no padding.
        q_pos = meta.positions.view(num_requests, max_q)
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & in_seq
        return _StepLayout(pages, None, None, mask[:, None])
    starts = meta.query_start_loc[:-1]
    q_lens = meta.query_start_loc[1:] - starts
    offs = torch.arange(max_q, device=device)
    valid = offs[None, :] < q_lens[:, None]  # [B, max_q]
    token_idx = (starts[:, None] + offs[None, :]).clamp(max=num_tokens - 1)
    q_pos = meta.positions[token_idx]  # [B, max_q]
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & in_seq
    mask |= ~valid[:, :, None] & (key_pos[None, None, :] == 0)  # padding rows: no NaN
    return _StepLayout(pages, token_idx, valid, mask[:, None])
