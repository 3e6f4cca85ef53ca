"""Tensor-parallel layers: how a rank's share of each weight is laid out and combined.

- Column-parallel projections (q/k/v by heads, gate/up by columns) are `MergedLinear`s of
  the rank's rows; `MergedLinear.slices` says which rows of each checkpoint tensor those are.
- Row-parallel projections (o_proj, down_proj) are `nn.Linear`s over the rank's input
  columns (`row_parallel_linear`, with `weight_slice`); the block that owns one all-reduces
  its output, always reduced first (never a split-K GEMV's unreduced partial sums).
- The embedding and the logits projection are vocabulary-parallel: each rank holds a
  contiguous shard of the vocabulary (the last one padded), lookups outside it give zeros
  and are all-reduced, logits are all-gathered (`gather_logits`).

The loader reads `weight_slice` / `MergedLinear.slices` to fetch only the rank's part of a
checkpoint tensor. At size 1 every slice is None and every collective a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.core.errors import ConfigError
from specserve.core.model_config import ModelConfig
from specserve.core.parallel import SINGLE_RANK, TensorParallel, TensorSlice, split_evenly


@dataclass(frozen=True)
class AttentionHeads:
    """The query and KV heads one rank holds: `q_count` query heads from `q_start`, and the
    `kv_count` KV heads from `kv_start` that they read (local q / local kv keeps the model's
    GQA ratio)."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def attention_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> AttentionHeads:
    """Query heads split evenly; KV heads split too when there are at least as many as ranks,
    else each rank keeps (a replica of) the one KV head its query heads share."""
    q_count = tp.split(num_heads, "num_heads")
    q_start = tp.rank * q_count
    kv_count = kv_heads_per_rank(num_kv_heads, tp.size)
    if num_kv_heads >= tp.size:
        return AttentionHeads(q_start, q_count, tp.rank * kv_count, kv_count)
    group = num_heads // num_kv_heads  # query heads per KV head
    return AttentionHeads(q_start, q_count, q_start // group, 1)


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """The KV heads each of `size` ranks holds: an even share, or one replicated head when
    there are fewer KV heads than ranks (ConfigError when neither fits)."""
    if num_kv_heads >= size:
        return split_evenly(num_kv_heads, size, "num_kv_heads")
    if size % num_kv_heads:
        raise ConfigError(
            f"tensor_parallel_size {size} is not a multiple of num_kv_heads "
            f"{num_kv_heads}: ranks would hold different numbers of KV heads"
        )
    return 1


def check_shards(cfg: ModelConfig, size: int, what: str) -> None:
    """ConfigError naming `what` (e.g. "the model") when a model of `cfg` cannot be split
    over `size` ranks as the layers split it: checked once before any rank starts, so the
    user reads one line rather than every rank's traceback."""
    try:
        split_evenly(cfg.num_heads, size, "num_heads")
        kv_heads_per_rank(cfg.num_kv_heads, size)
        split_evenly(cfg.intermediate_size, size, "intermediate_size")
    except ConfigError as e:
        raise ConfigError(f"{what} cannot be split over {size} ranks: {e}") from None


def head_slice(start: int, count: int, total: int, head_dim: int, tp: TensorParallel):
    """The rows of `count` heads from `start` in a [total * head_dim, ...] projection (None
    at size 1)."""
    if tp.size == 1:
        return None
    return TensorSlice(0, start * head_dim, count * head_dim, total * head_dim)


def row_parallel_linear(
    in_features: int, out_features: int, tp: TensorParallel, what: str
) -> nn.Linear:
    """An nn.Linear over this rank's contiguous share of the input features; its owner
    all-reduces the output. `what` names the split quantity in the error when uneven."""
    part = tp.even_slice(1, in_features, what)
    linear = nn.Linear(in_features if part is None else part.length, out_features, bias=False)
    linear.weight_slice = part
    return linear


def vocab_slice(vocab_size: int, tp: TensorParallel) -> TensorSlice | None:
    """This rank's rows of a [vocab, ...] tensor (shards of `padded_rows`; the last ones may
    hold fewer real rows, or none)."""
    if tp.size == 1:
        return None
    rows = tp.padded_rows(vocab_size)
    start = min(tp.rank * rows, vocab_size)
    return TensorSlice(0, start, min(rows, vocab_size - start), vocab_size)


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding over this rank's shard of the vocabulary (`vocab_slice`, padded to
    `padded_rows` rows): ids outside it embed to zeros, then the ranks' embeddings are
    summed, so every rank returns the full embedding of every id. At size 1, nn.Embedding."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel = SINGLE_RANK):
        super().__init__(tp.padded_rows(vocab_size), dim)
        self.tp = tp
        self.vocab_size = vocab_size
        self.weight_slice = vocab_slice(vocab_size, tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        part = self.weight_slice
        if part is None:
            return super().forward(ids)
        local = ids - part.start
        inside = (local >= 0) & (local < part.length)
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        out = out.masked_fill(~inside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


def vocab_parallel_head(hidden: int, vocab_size: int, tp: TensorParallel) -> nn.Linear:
    """The untied logits projection over this rank's vocabulary shard (rows as the
    embedding's; padding rows load as zeros and their logits are dropped)."""
    head = nn.Linear(hidden, tp.padded_rows(vocab_size), bias=False)
    head.weight_slice = vocab_slice(vocab_size, tp)
    return head


def gather_logits(logits: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    """The full [..., vocab] logits from every rank's shard of them (padding dropped)."""
    if tp.size == 1:
        return logits
    full = tp.all_gather(logits, dim=-1)
    return full if full.shape[-1] == vocab_size else full[..., :vocab_size].contiguous()
