"""A benchmark-only prototype of proposed changes to model/llama.py (another area's file):
q/k/v and gate/up projections merged into one GEMM each, and every residual add fused into
the RMSNorm after it (the stack passes (hidden, residual) pairs between layers).

Applied to a built model in place: the merged weights are concatenated once and the original
q/k/v and gate/up parameters become views into them, so memory and state dict stay as they
were. Numerics are unchanged (same roundings); only the kernel count per layer drops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.layers.activation import GatedMLP
from specserve.layers.triton_ops import add_rms_norm, silu_and_mul
from specserve.model.llama import Attention, LlamaForCausalLM


class MergedAttention(Attention):
    """One GEMM for q, k and v (Llama: no bias, no q/k norm)."""

    def forward(self, x, rotary, backend, kv, meta):
        t, d = x.shape[0], self.head_dim
        qkv = F.linear(x, self.qkv_weight)
        q_end, k_end = self.num_heads * d, (self.num_heads + self.num_kv_heads) * d
        q = qkv[:, :q_end].view(t, self.num_heads, d)
        k = qkv[:, q_end:k_end].view(t, self.num_kv_heads, d)
        v = qkv[:, k_end:].view(t, self.num_kv_heads, d)
        q, k = rotary(meta.positions, q, k)
        out = backend.forward(q, k, v, kv[0], kv[1], meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * d))


class MergedGatedMLP(GatedMLP):
    """One GEMM for gate and up, then the fused SiLU-and-mul."""

    def forward(self, x):
        gate_up = F.linear(x, self.gate_up_weight)
        half = gate_up.shape[-1] // 2
        return self.down_proj(silu_and_mul(gate_up[..., :half], gate_up[..., half:]))


class FusedResidualLlama(LlamaForCausalLM):
    """The decoder stack with each residual add done by the next RMSNorm's kernel."""

    def forward(self, input_ids, meta, kv_cache, backend, aux_layer_ids=()):
        assert not aux_layer_ids, "prototype: no aux hidden states"
        x, residual = self.model.embed_tokens(input_ids), None
        for i, layer in enumerate(self.model.layers):
            norm = layer.input_layernorm
            if residual is None:
                residual, h = x, norm(x)
            else:
                residual, h = add_rms_norm(x, residual, norm.weight, norm.eps)
            attn = layer.self_attn(h, self.rotary, backend, kv_cache[i], meta)
            post = layer.post_attention_layernorm
            residual, h = add_rms_norm(attn, residual, post.weight, post.eps)
            x = layer.mlp(h)
        final = self.model.norm
        return add_rms_norm(x, residual, final.weight, final.eps)[1], []


def _merge(weights: list[torch.nn.Parameter]) -> torch.Tensor:
    merged = torch.cat([w.data for w in weights])
    start = 0
    for w in weights:
        rows = w.shape[0]
        w.data = merged[start : start + rows]  # the original storage is freed
        start += rows
    return merged


def apply(model: LlamaForCausalLM) -> None:
    """Switch a (Llama-family, no bias, no q/k norm) model to the prototype in place."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.q_norm is None and attn.q_proj.bias is None
        attn.qkv_weight = _merge([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        mlp.gate_up_weight = _merge([mlp.gate_proj.weight, mlp.up_proj.weight])
        attn.__class__, mlp.__class__ = MergedAttention, MergedGatedMLP
    model.__class__ = FusedResidualLlama
