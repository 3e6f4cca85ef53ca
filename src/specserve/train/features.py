"""The target's view of the training data: auxiliary hidden states, final hidden states and
argmax tokens over prompt + reply, recorded once with specserve's own LlamaForCausalLM.

specserve's model (not transformers) records them because it is the model that serves: the
auxiliary states are exactly what the eagle3 proposer reads at serving time (the residual
stream entering the configured layers, same numerics, same dtype), and it needs no
`output_hidden_states` copy of every layer. Logits are not stored (49k floats a token):
the final hidden state is, and the target's logits over the draft vocabulary are one matmul
away at training time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from specserve.layers.attention import AttentionMetadata, TorchAttentionBackend
from specserve.model.llama import LlamaForCausalLM
from specserve.train.distill import Sample


def dense_metadata(lengths: list[int], page_size: int, device: torch.device) -> AttentionMetadata:
    """Metadata for whole sequences packed one after another, each on its own run of pages
    (page 0 stays the scratch page)."""
    positions, slots, tables = [], [], []
    starts = [0]
    next_page = 1
    max_pages = max(-(-n // page_size) for n in lengths)
    for n in lengths:
        pages = list(range(next_page, next_page + -(-n // page_size)))
        next_page += len(pages)
        positions += range(n)
        slots += [pages[p // page_size] * page_size + p % page_size for p in range(n)]
        tables.append(pages + [0] * (max_pages - len(pages)))
        starts.append(starts[-1] + n)

    def t(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return AttentionMetadata(
        positions=t(positions),
        slot_mapping=t(slots),
        query_start_loc=t(starts),
        seq_lens=t(lengths),
        block_tables=t(tables),
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
    )


@dataclass
class FeatureStore:
    """Per-token target features of all samples, packed; sample i owns rows
    offsets[i]:offsets[i+1]."""

    aux: torch.Tensor  # [N, 3*H] inputs of the auxiliary layers, concatenated low/mid/high
    hidden: torch.Tensor  # [N, H] final normed hidden state
    argmax: torch.Tensor  # [N] the target's most likely next token
    tokens: torch.Tensor  # [N] the token at each position
    offsets: list[int]
    prompt_lens: list[int]

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def length(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]

    def batch(self, indices: list[int], max_len: int | None = None) -> Batch:
        return make_batch(self, indices, max_len)

    def subset(self, count: int) -> FeatureStore:
        """The first `count` samples (views, no copies)."""
        n = min(count, len(self))
        end = self.offsets[n]
        return FeatureStore(
            self.aux[:end],
            self.hidden[:end],
            self.argmax[:end],
            self.tokens[:end],
            self.offsets[: n + 1],
            self.prompt_lens[:n],
        )


class LiveFeatures:
    """A FeatureStore's interface with nothing kept: each batch's features are the target's
    forward over its samples when the batch is asked for (`record_features` on them), so
    the training data is not bounded by the device memory a store takes (4 x hidden size x
    2 bytes a token: 10M tokens of SmolLM2-135M are 43 GiB, about what 60% of an H100 holds
    beside training). The target's forward over a batch is a small part of a training step
    that unrolls the head several times with its backward passes; the features are the
    same as a store's, up to the order of the batched sums."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        samples: list[Sample],
        aux_layer_ids: tuple[int, ...],
        page_size: int = 16,
    ):
        self.model, self.samples, self.aux_layer_ids = model, samples, aux_layer_ids
        self.page_size = page_size
        self.offsets = [0]
        for s in samples:
            self.offsets.append(self.offsets[-1] + len(s.token_ids))
        self.prompt_lens = [s.prompt_len for s in samples]

    def __len__(self) -> int:
        return len(self.samples)

    def length(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]

    def batch(self, indices: list[int], max_len: int | None = None) -> Batch:
        # (causal: the features of a sample's first max_len tokens are those of the cut one)
        cut = [
            Sample(s.key, s.token_ids[:max_len] if max_len else s.token_ids, s.prompt_len)
            for s in (self.samples[i] for i in indices)
        ]
        store = record_features(
            self.model,
            cut,
            self.aux_layer_ids,
            sum(len(s.token_ids) for s in cut),
            self.page_size,
            progress=False,
        )
        return make_batch(store, list(range(len(cut))), max_len)

    def subset(self, count: int) -> LiveFeatures:
        return LiveFeatures(self.model, self.samples[:count], self.aux_layer_ids, self.page_size)


@torch.inference_mode()
def record_features(
    model: LlamaForCausalLM,
    samples: list[Sample],
    aux_layer_ids: tuple[int, ...],
    tokens_per_batch: int,
    page_size: int = 16,
    progress: bool = True,
) -> FeatureStore:
    """Run the target over every sample (batches of about `tokens_per_batch` tokens)."""
    cfg = model.config
    device = model.model.embed_tokens.weight.device
    dtype = model.model.embed_tokens.weight.dtype
    lengths = [len(s.token_ids) for s in samples]
    total = sum(lengths)
    aux = torch.empty(total, 3 * cfg.hidden_size, dtype=dtype, device=device)
    hidden = torch.empty(total, cfg.hidden_size, dtype=dtype, device=device)
    argmax = torch.empty(total, dtype=torch.int64, device=device)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    # KV pages for the largest batch, reused by every batch.
    max_batch = max(min(tokens_per_batch, total), max(lengths))
    max_count = min(256, len(samples))
    num_pages = max_batch // page_size + max_count + 2
    kv_shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    # Zeroed: attention reads whole pages, and 0 * NaN from stale memory past a sequence's
    # end would poison the masked sum.
    kv = [
        (
            torch.zeros(kv_shape, dtype=dtype, device=device),
            torch.zeros(kv_shape, dtype=dtype, device=device),
        )
        for _ in range(cfg.num_layers)
    ]
    backend = TorchAttentionBackend()
    bar = tqdm(total=total, desc="Recording target features", unit="tok", disable=not progress)
    i = 0
    while i < len(samples):
        j = i + 1
        while j < len(samples) and j - i < max_count and offsets[j + 1] - offsets[i] <= max_batch:
            j += 1
        ids = torch.tensor([t for s in samples[i:j] for t in s.token_ids], device=device)
        meta = dense_metadata(lengths[i:j], page_size, device)
        final, aux_list = model(ids, meta, kv, backend, aux_layer_ids)
        rows = slice(offsets[i], offsets[j])
        aux[rows] = torch.cat(aux_list, dim=-1)
        hidden[rows] = final
        for c in range(0, final.shape[0], 4096):  # full-vocabulary logits in chunks
            top = model.compute_logits(final[c : c + 4096]).argmax(-1)
            argmax[offsets[i] + c : offsets[i] + c + top.shape[0]] = top
        bar.update(offsets[j] - offsets[i])
        i = j
    bar.close()
    tokens = torch.tensor([t for s in samples for t in s.token_ids], device=device)
    return FeatureStore(aux, hidden, argmax, tokens, offsets, [s.prompt_len for s in samples])


@dataclass
class Batch:
    """Samples padded on the right to one length L."""

    aux: torch.Tensor  # [B, L, 3H]
    hidden: torch.Tensor  # [B, L, H]
    argmax: torch.Tensor  # [B, L]
    tokens: torch.Tensor  # [B, L]
    lengths: torch.Tensor  # [B]
    prompt_lens: torch.Tensor  # [B]
    host_lengths: list[int]  # the same two on the host: which positions count is known
    host_prompt_lens: list[int]  # without waiting for the device


def make_batch(store: FeatureStore, indices: list[int], max_len: int | None = None) -> Batch:
    """Gather samples into a padded batch (each cut to `max_len` tokens)."""
    lens = [store.length(i) if max_len is None else min(store.length(i), max_len) for i in indices]
    width = -(-max(lens) // 16) * 16  # aligned widths keep fused attention kernels eligible
    device = store.aux.device
    rows = torch.zeros(len(indices), width, dtype=torch.int64)  # built on the host, one copy
    for b, (i, n) in enumerate(zip(indices, lens)):
        rows[b, :n] = torch.arange(store.offsets[i], store.offsets[i] + n)
        rows[b, n:] = store.offsets[i]  # padding repeats a real row; masked out later
    if device.type == "cuda":
        rows = rows.pin_memory()
    rows = rows.to(device, non_blocking=True)
    prompt_lens = [store.prompt_lens[i] for i in indices]
    return Batch(
        aux=store.aux[rows],
        hidden=store.hidden[rows],
        argmax=store.argmax[rows],
        tokens=store.tokens[rows],
        lengths=torch.tensor(lens, device=device),
        prompt_lens=torch.tensor(prompt_lens, device=device),
        host_lengths=lens,
        host_prompt_lens=prompt_lens,
    )
