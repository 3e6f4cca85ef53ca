"""Llama-family decoder (Llama, Qwen2 with qkv bias, Qwen3 with q/k norm) over paged KV.

Parameter names follow Hugging Face checkpoints except where projections are merged for
speed: q/k/v are one `qkv_proj` and gate/up one `gate_up_proj` (`MergedLinear`); the loader
fills their row ranges from the checkpoint's separate tensors, under the checkpoint's names.

The layers carry (hidden, residual) pairs: each residual add happens inside the RMSNorm that
follows it (`norm(x, residual)`), one kernel on the GPU, same rounding as a plain add.

Built for a `TensorParallel` rank, every layer holds that rank's share (layers/parallel.py):
attention heads and MLP columns split, the residual stream replicated after each
all-reduce, the vocabulary sharded and the logits gathered, so every rank computes the same
hidden states and logits as the unsharded model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from specserve.core.model_config import ModelConfig
from specserve.core.parallel import SINGLE_RANK, TensorParallel
from specserve.layers.activation import MergedGatedMLP
from specserve.layers.attention import AttentionBackend, AttentionMetadata
from specserve.layers.linear import NORM_FUSION, MergedLinear, dense
from specserve.layers.norm import RMSNorm
from specserve.layers.parallel import (
    VocabParallelEmbedding,
    attention_heads,
    gather_logits,
    head_slice,
    row_parallel_linear,
    vocab_parallel_head,
)
from specserve.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from specserve.kernels.gemv_plan import GemvPlan

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class Attention(nn.Module):
    """Grouped-query self-attention with rotary embedding and optional q/k RMSNorm.

    With `split_k_to_norm` (set by triton_ops.use_triton_ops) and `defer_reduce`, an output
    projection that the GEMV plan serves with a K split returns its partial sums unreduced
    (`gemv.SplitKSum`) for the RMSNorm with residual after it to reduce. With `rope_in_qkv`
    (set alike), where the rotary module stores K/V itself and the plan serves the qkv
    projection with a Triton tile that fits (`gemv.rope_fits`), rotary and the K/V store run
    in that GEMV's epilogue (`gemv` rope): one kernel before attention, same results.

    Under tensor parallelism (`tp`) it holds the rank's query heads and the KV heads they
    read (`num_heads`, `num_kv_heads` are this rank's; `attention_heads`), o_proj is
    row-parallel and its reduced output all-reduced (never deferred to the norm)."""

    split_k_to_norm = False
    rope_in_qkv = False

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE_RANK):
        super().__init__()
        self.tp = tp
        heads = attention_heads(cfg.num_heads, cfg.num_kv_heads, tp)
        self.num_heads = heads.q_count
        self.num_kv_heads = heads.kv_count
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        h, d = cfg.hidden_size, cfg.head_dim
        self.split_sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        names = ("q_proj", "k_proj", "v_proj")
        kv = head_slice(heads.kv_start, heads.kv_count, cfg.num_kv_heads, d, tp)
        slices = [head_slice(heads.q_start, heads.q_count, cfg.num_heads, d, tp), kv, kv]
        self.qkv_proj = MergedLinear(
            h, dict(zip(names, self.split_sizes)), cfg.qkv_bias, dict(zip(names, slices))
        )
        self.o_proj = row_parallel_linear(cfg.num_heads * d, h, tp, "num_heads * head_dim")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, rotary, backend, kv, meta: AttentionMetadata, defer_reduce=False):
        t = x.shape[0]
        if self.q_norm is None and fused_kv_store(rotary, backend):
            # Rotary of q and k and the K/V store in one kernel (the qkv GEMV's epilogue, or
            # a kernel of their own); the backend only attends.
            q = self._qkv_rotate_and_store(x, rotary, kv, meta)
            out = backend.forward(q, None, None, kv[0], kv[1], meta, self.scale)
            return self._output(out.reshape(t, self.num_heads * self.head_dim), defer_reduce)
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(meta.positions, q, k)
        out = backend.forward(q, k, v, kv[0], kv[1], meta, self.scale)
        return self._output(out.reshape(t, self.num_heads * self.head_dim), defer_reduce)

    def _qkv_rotate_and_store(self, x, rotary, kv, meta) -> torch.Tensor:
        """Rotated q [T, heads, D]; k rotated and v stored into the paged cache `kv`."""
        proj = self.qkv_proj
        plan = getattr(proj, "gemv_plan", None)
        if self.rope_in_qkv and plan is not None:
            from specserve.kernels import gemv  # a kernel module: imported when first used

            cfg = plan.config_for(x.shape[0], *proj.weight.shape, proj.weight.dtype)
            if cfg is not None and gemv.rope_fits(cfg, self.head_dim, proj.weight.shape[1]):
                store = gemv.RopeStore(
                    meta.positions,
                    meta.slot_mapping,
                    rotary.cos_sin,
                    self.num_heads,
                    self.num_kv_heads,
                    kv[0],
                    kv[1],
                )
                return gemv.gemv(x, proj.weight, proj.bias, cfg, rope=store)
        return rotary.rotate_and_store(
            meta.positions,
            proj(x),
            self.num_heads,
            self.num_kv_heads,
            kv[0],
            kv[1],
            meta.slot_mapping,
        )

    def _output(self, out: torch.Tensor, defer_reduce: bool):
        o = self.o_proj
        if self.tp.size > 1:  # the rank's whole partial sum, then the sum over ranks
            return self.tp.all_reduce(o(out))
        plan = getattr(o, "gemv_plan", None)
        if not (defer_reduce and self.split_k_to_norm) or plan is None:
            return o(out)
        # the configuration start-up selection timed with the norm after it, if it did
        cfg = plan.config_for(out.shape[0], *o.weight.shape, o.weight.dtype, NORM_FUSION)
        if cfg is None:  # measured slower than the plain choice (whose split defers too)
            return dense(out, o.weight, o.bias, plan, defer_reduce=True)
        from specserve.kernels.gemv import gemv  # a kernel module: imported when first used

        return gemv(out, o.weight, o.bias, cfg, defer_reduce=True)


def fused_kv_store(rotary, backend) -> bool:
    """Whether the rotary module can store K/V itself (the Triton one) for a backend that
    then skips its own KV write (the Triton backend, given k = v = None)."""
    return getattr(rotary, "stores_kv", False) and backend.name == "triton"


class DecoderLayer(nn.Module):
    """Attention and MLP blocks; (x, residual) in, (x, residual) out, where the residual
    stream entering the layer is x + residual (just x for the first layer: residual None).
    The x a layer returns may be a split-K GEMV's unreduced output (`gemv.SplitKSum`, on the
    Triton path), which only an RMSNorm with residual reads."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE_RANK):
        super().__init__()
        self.self_attn = Attention(cfg, tp)
        self.mlp = MergedGatedMLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rotary, backend, kv, meta, aux: list | None = None):
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        if aux is not None:
            aux.append(residual)  # the residual stream entering this layer
        # the output enters the post-attention norm only, which may run o_proj's last pass
        h = self.self_attn(h, rotary, backend, kv, meta, defer_reduce=True)
        h, residual = self.post_attention_layernorm(h, residual)
        # The output only ever enters the next RMSNorm with this residual (the next layer's
        # or the final norm), which may run the down projection's last pass (triton_ops.py).
        return self.mlp(h, defer_reduce=True), residual


class DecoderStack(nn.Module):
    """Embedding, decoder layers and final norm (Hugging Face's `model.` prefix)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE_RANK):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The target model: tokens and paged KV in, final hidden states out.

    `aux_layer_ids` asks for the hidden states entering those layers (EAGLE-3 reads the
    target's low/mid/high features); they are returned alongside the final hidden states.

    Built for rank `tp.rank` of a tensor-parallel group, it holds that rank's shard and its
    forward runs the group's collectives (every rank calls it with the same inputs); hidden
    states, aux states and logits come out whole on every rank. `num_layers`,
    `num_kv_heads` (this rank's), `head_dim` and `kv_config` size the rank's KV cache.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE_RANK):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = DecoderStack(cfg, tp)
        if not cfg.tie_word_embeddings:
            self.lm_head = vocab_parallel_head(cfg.hidden_size, cfg.vocab_size, tp)
        heads = attention_heads(cfg.num_heads, cfg.num_kv_heads, tp)
        self.num_layers = cfg.num_layers
        self.num_heads = heads.q_count  # this rank's query heads
        self.num_kv_heads = heads.kv_count  # this rank's KV heads
        self.head_dim = cfg.head_dim
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling
        )
        self.gemv_plan: GemvPlan | None = None  # the logits projection's (`use_gemv`)

    @property
    def kv_config(self) -> ModelConfig:
        """The config this rank's KV cache is sized from (`KVCache(model.kv_config, ...)`):
        the model's, with this rank's head counts."""
        if self.tp.size == 1:
            return self.config
        return replace(self.config, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """This rank's rows of the logits projection (the embedding's when tied)."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        backend: AttentionBackend,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self.gemv_plan is not None:  # a verify row rounds as the request's decode row
            # (a step carrying a prefill chunk is outside batch invariance: by its rows)
            self.gemv_plan.step_requests = None if meta.prefill else meta.num_requests
        x, residual = self.model.embed_tokens(input_ids), None
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            wants = aux if i in aux_layer_ids else None
            x, residual = layer(x, residual, self.rotary, backend, kv_cache[i], meta, wants)
        if residual is None:  # no layers
            return self.model.norm(x), aux
        return self.model.norm(x, residual)[0], aux

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """fp32 logits for the given hidden states (fp32=False: in the activation dtype, for
        callers that only take their argmax: the same ids, no fp32 copy); the whole
        vocabulary's on every rank."""
        logits = dense(hidden, self.lm_head_weight, plan=self.gemv_plan)
        logits = gather_logits(logits, self.config.vocab_size, self.tp)
        return logits.float() if fp32 else logits
