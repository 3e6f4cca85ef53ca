"""Fused Triton kernels for the small per-layer ops: RMSNorm (optionally with the residual add
before it), rotary embedding (optionally with the paged KV write after it), SiLU-and-mul.

At decode batch sizes each of these is a handful of tiny PyTorch kernels (RMSNorm 6, rotary
about 12), which under CUDA graphs cost microseconds apiece with the GPU otherwise idle; one
kernel each pays. The numerics follow the PyTorch modules they replace, rounding to the
activation dtype at the same points, so greedy output does not drift from the reference.

`use_triton_ops(model)` switches a model's RMSNorm, RotaryEmbedding and (merged) gated-MLP
instances to the subclasses below in place (same parameters, buffers and state dict).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from specserve.layers.activation import GatedMLP, MergedGatedMLP
from specserve.layers.norm import RMSNorm
from specserve.layers.rotary import RotaryEmbedding


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps,
                     BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF: cast before weight
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, stride_x, stride_r, stride_s,
                         stride_o, n_cols, eps, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    dtype = sum_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    total = (x + r).to(dtype)  # the residual stream, rounded as `x + r` rounds
    tl.store(sum_ptr + row * stride_s + cols, total, mask=ok)
    t = total.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(t * t, 0) / n_cols + eps)
    y = (t * inv_rms).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rotate_rows(src, dst, src_stride_h, dst_stride_h, cos, sin, num_heads,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    """Rotate num_heads rows of one token (head h at src + h * src_stride_h) into dst."""
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    ok = (h < num_heads)[:, None] & (i < HALF)[None, :]
    src = src + h[:, None] * src_stride_h + i[None, :]
    dtype = src.dtype.element_ty
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    # Same rounding as the PyTorch path: each product and the sum in the activation dtype.
    o1 = _round(_round(x1 * cos, dtype) - _round(x2 * sin, dtype), dtype)
    o2 = _round(_round(x2 * cos, dtype) + _round(x1 * sin, dtype), dtype)
    dst = dst + h[:, None] * dst_stride_h + i[None, :]
    out_dtype = dst.dtype.element_ty
    tl.store(dst, o1.to(out_dtype), mask=ok)
    tl.store(dst + HALF, o2.to(out_dtype), mask=ok)


@triton.jit
def _rotate_heads(x_ptr, o_ptr, stride_t, stride_h, t, cos, sin, NUM_HEADS: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    _rotate_rows(x_ptr + t * stride_t, o_ptr + t * NUM_HEADS * 2 * HALF, stride_h, 2 * HALF,
                 cos, sin, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF)  # fmt: skip


@triton.jit
def _cos_sin(cos_sin_ptr, pos, stride_cs, DTYPE: tl.constexpr, HALF: tl.constexpr,
             BLOCK_HALF: tl.constexpr):  # fmt: skip
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=i_ok, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=i_ok, other=0.0)
    return _round(cos, DTYPE)[None, :], _round(sin, DTYPE)[None, :]


# Positions and slots are views into the step's one upload (runtime/packing.py), aligned or not
# with the token and request counts: not specialized on, or serving would compile new variants.
@triton.jit(do_not_specialize=["pos_ptr"])
def _rotary_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    cos, sin = _cos_sin(cos_sin_ptr, pos, stride_cs, q_ptr.dtype.element_ty, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr, qo_ptr, stride_qt, stride_qh, t, cos, sin, Q_HEADS, HALF, BLOCK_QH,
                  BLOCK_HALF)  # fmt: skip
    _rotate_heads(k_ptr, ko_ptr, stride_kt, stride_kh, t, cos, sin, K_HEADS, HALF, BLOCK_KH,
                  BLOCK_HALF)  # fmt: skip


@triton.jit(do_not_specialize=["pos_ptr", "slot_ptr"])
def _rotary_store_kv_kernel(
    qkv_ptr, qo_ptr, k_cache, v_cache, pos_ptr, slot_ptr, cos_sin_ptr,
    stride_t, stride_cs, stride_page, stride_slot,
    Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One token of a qkv projection row [q heads | k heads | v heads]: rotated q to qo,
    rotated k and v straight into the paged cache at the token's slot (< 0: not stored)."""
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    stored_heads = tl.where(slot >= 0, K_HEADS, 0)  # a negative slot: nothing stored
    slot = tl.maximum(slot, 0)
    row = qkv_ptr + t * stride_t
    cos, sin = _cos_sin(cos_sin_ptr, pos, stride_cs, qkv_ptr.dtype.element_ty, HALF, BLOCK_HALF)
    _rotate_rows(row, qo_ptr + t * Q_HEADS * HEAD_DIM, HEAD_DIM, HEAD_DIM, cos, sin, Q_HEADS,
                 HALF, BLOCK_QH, BLOCK_HALF)  # fmt: skip
    dst = (slot // PAGE_SIZE) * stride_page + (slot % PAGE_SIZE) * stride_slot
    _rotate_rows(row + Q_HEADS * HEAD_DIM, k_cache + dst, HEAD_DIM, HEAD_DIM, cos, sin,
                 stored_heads, HALF, BLOCK_KH, BLOCK_HALF)  # fmt: skip
    cols = tl.arange(0, BLOCK_V)
    v_ok = cols < stored_heads * HEAD_DIM
    v = tl.load(row + (Q_HEADS + K_HEADS) * HEAD_DIM + cols, mask=v_ok)
    tl.store(v_cache + dst + cols, v.to(v_cache.dtype.element_ty), mask=v_ok)


@triton.jit
def _silu_and_mul_kernel(g_ptr, u_ptr, o_ptr, stride_g, stride_u, stride_o, n_cols,
                         BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = o_ptr.dtype.element_ty
    act = _round(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(o_ptr + row * stride_o + cols, (act * u).to(dtype), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim, with RMSNorm's rounding."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.result_type(x, weight), device=x.device)
    n = x2.shape[-1]
    block = triton.next_power_of_2(n)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, out, x2.stride(0), out.stride(0), n, eps, BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + residual, rms_norm(x + residual)) in one kernel: the residual add of a decoder
    layer fused into the RMSNorm that follows it."""
    x2, r2 = _rows(x), _rows(residual)
    total = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x2.shape, dtype=torch.result_type(x, weight), device=x.device)
    n = x2.shape[-1]
    block = triton.next_power_of_2(n)
    if x2.shape[0]:
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, total, out, x2.stride(0), r2.stride(0), total.stride(0),
            out.stride(0), n, eps, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return total.view(x.shape), out.view(x.shape)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor):
    """Rotate-half rotary embedding of q [T, Hq, D] and k [T, Hk, D] (new tensors)."""
    num_tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    half = head_dim // 2
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos_sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
            Q_HEADS=q_heads, K_HEADS=k_heads, HALF=half,
            BLOCK_QH=triton.next_power_of_2(q_heads), BLOCK_KH=triton.next_power_of_2(k_heads),
            BLOCK_HALF=triton.next_power_of_2(half),
        )  # fmt: skip
    return q_out, k_out



def rotary_store_kv(positions: torch.Tensor, qkv: torch.Tensor, cos_sin: torch.Tensor,
                    q_heads: int, kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """From a qkv projection [T, (q_heads + 2 * kv_heads) * D]: rotary of q and k at
    `positions`, k and v stored at `slot_mapping` in the paged caches [pages, page_size,
    kv_heads, D] (slots < 0 skipped), all in one kernel; returns the rotated q [T, q_heads,
    D]. Same values as `rotary` followed by the attention backend's KV write."""
    from specserve.layers.attention.triton_kernels import check_cache

    num_tokens = qkv.shape[0]
    head_dim = k_cache.shape[3]
    if qkv.shape[1] != (q_heads + 2 * kv_heads) * head_dim or k_cache.shape[2] != kv_heads:
        raise ValueError("qkv rows must hold q_heads + 2 * kv_heads heads of the cache's size")
    check_cache(k_cache, v_cache)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q_out = torch.empty((num_tokens, q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    half = head_dim // 2
    if num_tokens:
        _rotary_store_kv_kernel[(num_tokens,)](
            qkv, q_out, k_cache, v_cache, positions, slot_mapping, cos_sin,
            qkv.stride(0), cos_sin.stride(0), k_cache.stride(0), k_cache.stride(1),
            Q_HEADS=q_heads, K_HEADS=kv_heads, HEAD_DIM=head_dim, HALF=half,
            PAGE_SIZE=k_cache.shape[1], BLOCK_QH=triton.next_power_of_2(q_heads),
            BLOCK_KH=triton.next_power_of_2(kv_heads), BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_V=triton.next_power_of_2(kv_heads * head_dim),
        )  # fmt: skip
    return q_out

def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, with F.silu's rounding to the activation dtype."""
    g2, u2 = _rows(gate), _rows(up)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    n = g2.shape[-1]
    block = min(2048, triton.next_power_of_2(n))
    if g2.shape[0]:
        _silu_and_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](
            g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), n, BLOCK=block,
        )  # fmt: skip
    return out.view(gate.shape)


class TritonRMSNorm(RMSNorm):
    """RMSNorm in one Triton kernel; with a residual, the add and the norm in one kernel."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            total, out = add_rms_norm(x, residual, self.weight, self.eps)
            return out, total
        return rms_norm(x, self.weight, self.eps)


class TritonRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding of q and k in one Triton kernel, reading the cos/sin table directly;
    `rotate_and_store` also writes k and v into the paged cache in the same kernel."""

    stores_kv = True  # models may hand it the KV write (`rotate_and_store`)

    def forward(self, positions, q, k):
        return rotary(positions, q, k, self.cos_sin)

    def rotate_and_store(self, positions, qkv, q_heads, kv_heads, k_cache, v_cache,
                         slot_mapping) -> torch.Tensor:  # fmt: skip
        """Rotated q [T, q_heads, D] from a qkv projection; rotated k and v stored."""
        return rotary_store_kv(positions, qkv, self.cos_sin, q_heads, kv_heads, k_cache,
                               v_cache, slot_mapping)  # fmt: skip


class TritonGatedMLP(GatedMLP):
    """Gated MLP whose SiLU and product are one Triton kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class TritonMergedGatedMLP(MergedGatedMLP):
    """Merged gate/up GEMM, then SiLU and product in one Triton kernel (strided halves)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(silu_and_mul(gate, up))


_FUSED = {
    RMSNorm: TritonRMSNorm,
    RotaryEmbedding: TritonRotaryEmbedding,
    GatedMLP: TritonGatedMLP,
    MergedGatedMLP: TritonMergedGatedMLP,
}


def use_triton_ops(model: nn.Module, enable: bool = True) -> int:
    """Switch (enable=False: switch back) the model's RMSNorm, rotary and gated-MLP modules to
    their Triton subclasses in place; returns how many modules changed."""
    mapping = _FUSED if enable else {v: k for k, v in _FUSED.items()}
    changed = 0
    for module in model.modules():
        new_class = mapping.get(type(module))
        if new_class is not None:
            module.__class__ = new_class
            changed += 1
    return changed
