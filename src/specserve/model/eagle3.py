"""EAGLE-3 draft head in the public checkpoint layout: config, strict loading, saving, forward.

The head is one Llama decoder layer whose attention reads the normed token embedding
concatenated with a normed hidden state (2*H inputs). Its first hidden state is `project(aux)`,
the fc over the target's low/mid/high auxiliary hidden states; in later draft steps it is the
head's own previous output. Logits cover a draft vocabulary; `d2t` maps a draft id to the
target id (target = draft + d2t[draft]) and `t2d` marks target ids in the draft vocabulary.

Auxiliary layers. `Eagle3Head.aux_layer_ids` names the target layers whose INPUT residual
stream is captured (pass it to `LlamaForCausalLM.forward(aux_layer_ids=...)`). The file's
`eagle_config.eagle_aux_hidden_state_layer_ids` follows the public convention of SGLang and
SpecForge: it lists layers whose OUTPUT is taken, so input ids = file ids + 1. When the key is
absent the default is the input of layers [2, L//2, L-3] of the target's L layers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.core.errors import CheckpointError, UnsupportedModelError
from specserve.core.model_config import ModelConfig
from specserve.core.parallel import SINGLE_RANK, TensorParallel
from specserve.layers.activation import GatedMLP, MergedGatedMLP
from specserve.layers.attention import AttentionBackend, AttentionMetadata
from specserve.layers.linear import MergedLinear
from specserve.layers.norm import RMSNorm
from specserve.layers.parallel import (
    attention_heads,
    gather_logits,
    head_slice,
    row_parallel_linear,
    vocab_parallel_head,
)
from specserve.layers.rotary import RotaryEmbedding
from specserve.layers.sampler import argmax_rows
from specserve.model.eagle3_config import (
    ARCHITECTURE,
    Eagle3Config,
    default_aux_layer_ids,
)
from specserve.model.llama import fused_kv_store

__all__ = [
    "ARCHITECTURE",
    "Eagle3Config",
    "Eagle3Head",
    "default_aux_layer_ids",
    "load_eagle3_head",
    "save_eagle3_head",
]
_IGNORED_TENSORS = ("embed_tokens.weight", "model.embed_tokens.weight")


class Eagle3Attention(nn.Module):
    """Grouped-query attention whose q/k/v read 2*H inputs (embedding ++ hidden); after
    `merge`, one `qkv_proj` holds the three (`merged()`). Under tensor parallelism (`tp`) it
    holds the rank's query heads and the KV heads they read (`num_heads`, `num_kv_heads`
    are this rank's), as the target's attention does, and o_proj is row-parallel (its owner
    all-reduces the output)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE_RANK):
        super().__init__()
        self.tp = tp
        heads = attention_heads(cfg.num_heads, cfg.num_kv_heads, tp)
        self.num_heads, self.num_kv_heads = heads.q_count, heads.kv_count
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        h2, d = 2 * cfg.hidden_size, cfg.head_dim
        self.split_sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        self.q_proj = nn.Linear(h2, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h2, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h2, self.num_kv_heads * d, bias=False)
        if tp.size > 1:  # the rows of the rank's heads (the loader reads only those)
            kv = head_slice(heads.kv_start, heads.kv_count, cfg.num_kv_heads, d, tp)
            self.q_proj.weight_slice = head_slice(
                heads.q_start, heads.q_count, cfg.num_heads, d, tp
            )
            self.k_proj.weight_slice = self.v_proj.weight_slice = kv
        self.o_proj = row_parallel_linear(cfg.num_heads * d, cfg.hidden_size, tp, "num_heads")

    def merge(self) -> None:
        """q/k/v stacked into one `qkv_proj` (the same values; one GEMM reads them)."""
        names = ("q_proj", "k_proj", "v_proj")
        parts = [getattr(self, name).weight for name in names]
        with torch.device("meta"):  # no full-size initialisation: the weights come next
            merged = MergedLinear(parts[0].shape[1], dict(zip(names, self.split_sizes)))
        merged.weight = _stacked(parts)
        for name in names:
            delattr(self, name)
        self.qkv_proj = merged

    def merged(self) -> MergedLinear | None:
        return self._modules.get("qkv_proj")

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding):
        """q [T, nh, d], k and v [T, nkv, d] with rotary applied at `positions` [T]."""
        t = x.shape[0]
        if self.merged() is not None:
            q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        return q, k, v


class Eagle3Layer(nn.Module):
    """The head's decoder layer (checkpoint prefix `midlayer.`), the rank's share of it
    under tensor parallelism."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE_RANK):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp)


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft head; parameter names are the public checkpoint's.

    Sharded for a tensor-parallel rank (`tp`), as the target is: the layer's heads and MLP
    columns split (its outputs all-reduced), the draft vocabulary split (logits gathered),
    `fc` whole on every rank (it reads the target's replicated residual stream, so the
    features need no gather). Every rank computes the same outputs and logits as the whole
    head; `kv_config` sizes the rank's share of the head's KV cache."""

    def __init__(
        self,
        cfg: Eagle3Config,
        aux_layer_ids: tuple[int, ...] = (),
        tp: TensorParallel = SINGLE_RANK,
    ):
        super().__init__()
        c = cfg.layer
        self.config = cfg
        self.tp = tp
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c, tp)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = vocab_parallel_head(c.hidden_size, cfg.draft_vocab_size, tp)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.rotary = RotaryEmbedding(
            c.head_dim, c.rope_theta, c.max_position_embeddings, c.rope_scaling
        )

    @property
    def kv_config(self) -> ModelConfig:
        """The config the head's KV cache is sized from: its layer's, with this rank's head
        counts."""
        attn = self.midlayer.self_attn
        return replace(self.config.layer, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """[T, 3*H_target] concatenated auxiliary hidden states -> [T, H]."""
        return self.fc(aux)

    def _layer_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        m = self.midlayer
        return torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden)], dim=-1)

    def _packed_layer_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`_layer_input` of packed tokens [T, H] without the concatenation: each norm writes
        its half of one [T, 2H] buffer (the same values; no autograd: serving only)."""
        m = self.midlayer
        h = embeds.shape[-1]
        dtype = torch.result_type(embeds, m.input_layernorm.weight)
        x = torch.empty(embeds.shape[0], 2 * h, dtype=dtype, device=embeds.device)
        m.input_layernorm.norm_into(embeds, x[:, :h])
        m.hidden_norm.norm_into(hidden, x[:, h:])
        return x

    def _mlp(self, attn_out: torch.Tensor, residual: torch.Tensor):
        """(MLP output, residual stream after attention): the layer's output is their sum."""
        normed, h = self.midlayer.post_attention_layernorm(attn_out, residual)  # one kernel
        return self.midlayer.mlp(normed), h

    def _finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        y, h = self._mlp(attn_out, residual)
        return h + y

    def merge_projections(self) -> Eagle3Head:
        """For serving: q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`, as the
        target's layers hold them (one weight-streaming GEMV each at decode sizes, and on
        the Triton path the rotary and K/V store in one kernel). Same values; training and
        `save_eagle3_head` keep the public layout of separate projections."""
        m = self.midlayer
        m.self_attn.merge()
        mlp = m.mlp
        gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        with torch.device("meta"):  # (the rank's columns: the whole MLP's, then its share)
            merged = MergedGatedMLP(down.shape[0], gate.shape[0] * mlp.tp.size, mlp.tp)
        merged.gate_up_proj.weight = _stacked([gate, up])
        merged.down_proj.weight = down
        m.mlp = merged
        return self

    def store_kv(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
    ) -> None:
        """The K/V `forward` writes for packed tokens [T, H] at `positions` into `slots`,
        without attending: a position's K/V depend on its own inputs only (the head has one
        layer), so a catch-up that only brings the head's KV up to date (nobody drafts from
        its outputs) needs the norms, the q/k/v projection and the rotary, not attention or
        the MLP."""
        attn = self.midlayer.self_attn
        x = self._packed_layer_input(embeds, hidden)
        if attn.merged() is not None and fused_kv_store(self.rotary, backend):
            self.rotary.rotate_and_store(
                positions, attn.qkv_proj(x), attn.num_heads, attn.num_kv_heads, kv[0], kv[1], slots
            )
        else:
            _, k, v = attn.qkv(x, positions, self.rotary)
            backend.store_kv(k, v, kv[0], kv[1], slots)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        kv: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        with_normed: bool = False,
    ):
        """One decoder layer over packed tokens [T, H], attending over the head's paged KV.

        Returns the pre-final-norm output, which is the next draft step's `hidden`; with
        `with_normed`, (that output, its final norm), the last residual add inside the norm
        (one kernel on the Triton path; the same sum as the plain add)."""
        attn = self.midlayer.self_attn
        x = self._packed_layer_input(embeds, hidden)
        if self.config.norm_before_residual:
            hidden = x[:, embeds.shape[-1] :].contiguous()  # the residual: the normed hidden
        if attn.merged() is not None and fused_kv_store(self.rotary, backend):
            # Rotary of q and k and the K/V store in one kernel; the backend only attends.
            q = self.rotary.rotate_and_store(
                meta.positions,
                attn.qkv_proj(x),
                attn.num_heads,
                attn.num_kv_heads,
                kv[0],
                kv[1],
                meta.slot_mapping,
            )
            out = backend.forward(q, None, None, kv[0], kv[1], meta, attn.scale)
        else:
            q, k, v = attn.qkv(x, meta.positions, self.rotary)
            out = backend.forward(q, k, v, kv[0], kv[1], meta, attn.scale)
        out = attn.tp.all_reduce(
            attn.o_proj(out.reshape(q.shape[0], attn.num_heads * attn.head_dim))
        )
        if with_normed:
            y, h = self._mlp(out, hidden)
            normed, total = self.norm(y, h)
            return total, normed
        return self._finish(out, hidden)

    def forward_dense(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        past_kv: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The same layer with dense attention, for training.

        embeds, hidden: [B, L, H]; positions: [B, L] rotary positions. Keys are the K/V of
        `past_kv` (earlier unrolled steps, each [B, nkv, L_i, d]) followed by this call's own;
        `attn_mask` [L, L_keys] (or broadcastable to [B, 1, L, L_keys]), True = attend, is
        required with `past_kv`; without both, attention is causal. Returns the output
        [B, L, H] and this call's (k, v) for later steps.
        """
        b, n, _ = embeds.shape
        attn = self.midlayer.self_attn
        x = self._layer_input(embeds, hidden)
        if self.config.norm_before_residual:
            hidden = x[..., embeds.shape[-1] :]  # the residual: the normed hidden
        x = x.reshape(b * n, -1)
        q, k, v = attn.qkv(x, positions.reshape(-1), self.rotary)
        q = q.view(b, n, attn.num_heads, -1).transpose(1, 2)
        k = k.view(b, n, attn.num_kv_heads, -1).transpose(1, 2)
        v = v.view(b, n, attn.num_kv_heads, -1).transpose(1, 2)
        keys = torch.cat([pk for pk, _ in past_kv] + [k], dim=2)
        values = torch.cat([pv for _, pv in past_kv] + [v], dim=2)
        group = attn.num_heads // attn.num_kv_heads
        if group > 1:
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        if attn_mask is None:
            if past_kv:
                raise ValueError("forward_dense with past_kv needs an attn_mask")
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=attn.scale)
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=attn_mask, scale=attn.scale
            )
        out = attn.tp.all_reduce(attn.o_proj(out.transpose(1, 2).reshape(b, n, -1)))
        return self._finish(out, hidden), (k, v)

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        """fp32 draft-vocabulary logits of head outputs (the whole draft vocabulary's on
        every rank)."""
        return self._logits(self.norm(out)).float()

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.lm_head(normed), self.config.draft_vocab_size, self.tp)

    def greedy(self, out: torch.Tensor) -> torch.Tensor:
        """The argmax draft ids of head outputs: compute_logits' argmax, without its fp32
        copy (exact, so the same ids; the first of equal maxima either way)."""
        return self.greedy_normed(self.norm(out))

    def greedy_normed(self, normed: torch.Tensor) -> torch.Tensor:
        """`greedy` of outputs already through the final norm (forward's `with_normed`)."""
        return argmax_rows(self._logits(normed))

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target-vocabulary ids."""
        return ids + self.d2t[ids]


def _stacked(weights: list[torch.Tensor]) -> nn.Parameter:
    """The weights stacked along their rows, as a parameter that keeps their requires_grad
    (loaded heads: False)."""
    with torch.no_grad():
        stacked = torch.cat(weights)
    return nn.Parameter(stacked, requires_grad=weights[0].requires_grad)


def _check_maps(d2t: torch.Tensor, t2d: torch.Tensor, cfg: Eagle3Config) -> None:
    target_ids = torch.arange(cfg.draft_vocab_size) + d2t.long()
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= cfg.vocab_size:
        raise CheckpointError(
            f"d2t maps draft ids outside the target vocabulary [0, {cfg.vocab_size})"
        )
    if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d.bool()[target_ids].all()):
        raise CheckpointError("t2d does not mark exactly the target ids that d2t maps to")


def check_head_fits(cfg: Eagle3Config, folder: str | Path, target_config: ModelConfig) -> None:
    """CheckpointError or UnsupportedModelError when the head in `folder` was made for
    another target (vocabulary, hidden size): from the configs alone, so an engine can say
    it before loading either model's weights."""
    if cfg.vocab_size != target_config.vocab_size:
        raise CheckpointError(
            f"the EAGLE-3 head in {folder} was made for a vocabulary of {cfg.vocab_size} tokens; "
            f"the target has {target_config.vocab_size}: use a head trained for this target"
        )
    if cfg.target_hidden_size != target_config.hidden_size:
        raise CheckpointError(
            f"the EAGLE-3 head in {folder} reads target hidden states of size "
            f"{cfg.target_hidden_size}; the target's hidden size is {target_config.hidden_size}"
        )
    if cfg.hidden_size != target_config.hidden_size:
        raise UnsupportedModelError(
            f"the EAGLE-3 head in {folder} has hidden size {cfg.hidden_size}, the target "
            f"{target_config.hidden_size}: specserve feeds the head the target's token "
            "embeddings, so the two must match"
        )


def load_eagle3_head(
    folder: str | Path,
    target_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TensorParallel = SINGLE_RANK,
) -> Eagle3Head:
    """Build the head on the meta device and fill it strictly from `folder` (with `tp`, the
    rank's shard, reading only its part of each tensor).

    Fails with CheckpointError on missing or extra tensors, shape mismatches, or a head made
    for another target (hidden size or vocabulary)."""

    from specserve.model.checkpoint import assign_weights
    from specserve.model.loader import SafetensorsTensor, safetensors_handles

    folder = Path(folder)
    cfg = Eagle3Config.load(folder)
    check_head_fits(cfg, folder, target_config)
    # Drafts run at the target's positions: the head's rotary covers the target's context
    # (rotary is a formula of the position; llama3 scaling reads its own original length).
    positions = max(cfg.layer.max_position_embeddings, target_config.max_position_embeddings)
    cfg = replace(cfg, layer=replace(cfg.layer, max_position_embeddings=positions))
    aux_ids = cfg.aux_layer_ids(target_config.num_layers)
    with torch.device("meta"):
        head = Eagle3Head(cfg, aux_ids, tp)
    buffers = {"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)}
    found: dict[str, torch.Tensor] = {}
    handles = safetensors_handles(folder)

    def weights():
        for h in handles:
            for name in h.keys():
                if name in _IGNORED_TENSORS:
                    continue  # some heads ship the target's embedding; the target's is used
                if name in buffers:
                    found[name] = h.get_tensor(name)
                    continue
                yield name, SafetensorsTensor(h, name)  # (read when assigned: the part)

    assign_weights(head, weights(), dtype, torch.device(device))
    for name, shape in buffers.items():
        if name not in found:
            raise CheckpointError(f"EAGLE-3 head in {folder} lacks the tensor {name!r}")
        if tuple(found[name].shape) != shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(found[name].shape)}, the config implies {shape}"
            )
    _check_maps(found["d2t"], found["t2d"], cfg)
    head.d2t = found["d2t"].to(device=device, dtype=torch.int64)
    head.t2d = found["t2d"].to(device=device, dtype=torch.bool)
    head.rotary.materialize(torch.device(device))
    return head.eval()


def save_eagle3_head(head: Eagle3Head, folder: str | Path) -> Path:
    """Write config.json and model.safetensors in the public EAGLE-3 layout."""
    from safetensors.torch import save_file

    if head.midlayer.self_attn.merged() is not None:
        raise ValueError(
            "save_eagle3_head writes the public layout: save the head before "
            "merge_projections (a serving head's qkv_proj is not a checkpoint name)"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().cpu().contiguous() for n, p in head.named_parameters()}
    tensors["d2t"] = head.d2t.detach().cpu().to(torch.int64).contiguous()
    tensors["t2d"] = head.t2d.detach().cpu().to(torch.bool).contiguous()
    dtype = head.lm_head.weight.dtype
    (folder / "config.json").write_text(json.dumps(head.config.to_dict(dtype), indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
