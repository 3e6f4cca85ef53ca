"""Fused Triton kernels for the small per-layer ops: RMSNorm (optionally with the residual add
before it; kernels in triton_norm.py), rotary embedding (optionally with the paged KV write
after it), SiLU-and-mul.

At decode batch sizes each of these is a handful of tiny PyTorch kernels (RMSNorm 6, rotary
about 12), which under CUDA graphs cost microseconds apiece with the GPU otherwise idle; one
kernel each pays. The numerics follow the PyTorch modules they replace, rounding to the
activation dtype at the same points, so greedy output does not drift from the reference.

`use_triton_ops(model)` switches a model's RMSNorm, RotaryEmbedding and (merged) gated-MLP
instances to the subclasses below in place (same parameters, buffers and state dict). With
`fuse` (the default), where the Triton GEMV serves a merged MLP's down projection (as
start-up selection times it, fused), two more kernel boundaries go, with the same results:
SiLU-and-mul becomes the GEMV's prologue, and with a K split the GEMV's second pass runs
inside the RMSNorm after it, with the residual add (the decoder layer hands its MLP output
to that norm: `forward(x, defer_reduce=True)`); where the down projection takes no
prologue and the Triton GEMV serves gate/up, SiLU-and-mul becomes that GEMV's epilogue
instead. The attention block's output projection,
where the plan splits its K, hands its unreduced sums to the post-attention norm alike
(`Attention.split_k_to_norm`, model/llama.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from specserve.core.parallel import SINGLE_RANK
from specserve.kernels import pdl
from specserve.kernels.gemv import SplitKSum, gemv, silu_mul
from specserve.kernels.gemv_configs import gated_config
from specserve.kernels.pdl_kernel import pdl_enter
from specserve.kernels.triton_norm import (
    add_rms_norm,
    rms_norm,
    split_k_add_rms_norm,
)
from specserve.kernels.triton_rotary import rotary, rotary_store_kv
from specserve.layers.activation import GatedMLP, MergedGatedMLP
from specserve.layers.linear import dense
from specserve.layers.norm import RMSNorm
from specserve.layers.rotary import RotaryEmbedding


@triton.jit
def _silu_and_mul_kernel(
    g_ptr,
    u_ptr,
    o_ptr,
    stride_g,
    stride_u,
    stride_o,
    n_cols,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        pdl_enter()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0)
    # the arithmetic of the GEMV's SiLU prologue (gemv.silu_mul), so the two round alike
    tl.store(o_ptr + row * stride_o + cols, silu_mul(g, u, o_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, with F.silu's rounding to the activation dtype."""
    g2, u2 = _rows(gate), _rows(up)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    n = g2.shape[-1]
    block = min(2048, triton.next_power_of_2(n))
    if g2.shape[0]:
        _silu_and_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](
            g2,
            u2,
            out,
            g2.stride(0),
            u2.stride(0),
            out.stride(0),
            n,
            BLOCK=block,
            **pdl.launch_options(gate.device),
        )
    return out.view(gate.shape)


class TritonRMSNorm(RMSNorm):
    """RMSNorm in one Triton kernel; with a residual, the add and the norm in one kernel. x
    may be a split-K GEMV's unreduced output (`SplitKSum`): its second pass joins them."""

    def forward(self, x, residual: torch.Tensor | None = None):
        if residual is not None:
            if isinstance(x, SplitKSum):
                total, out = split_k_add_rms_norm(x, residual, self.weight, self.eps)
            else:
                total, out = add_rms_norm(x, residual, self.weight, self.eps)
            return out, total
        if isinstance(x, SplitKSum):
            x = x.reduce()
        return rms_norm(x, self.weight, self.eps)

    def norm_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        rms_norm(x, self.weight, self.eps, out=out)  # the kernel writes there: no copy


class TritonRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding of q and k in one Triton kernel, reading the cos/sin table directly;
    `rotate_and_store` also writes k and v into the paged cache in the same kernel."""

    stores_kv = True  # models may hand it the KV write (`rotate_and_store`)

    def forward(self, positions, q, k):
        return rotary(positions, q, k, self.cos_sin)

    def rotate_and_store(
        self, positions, qkv, q_heads, kv_heads, k_cache, v_cache, slot_mapping
    ) -> torch.Tensor:
        """Rotated q [T, q_heads, D] from a qkv projection; rotated k and v stored."""
        return rotary_store_kv(
            positions, qkv, self.cos_sin, q_heads, kv_heads, k_cache, v_cache, slot_mapping
        )


class TritonGatedMLP(GatedMLP):
    """Gated MLP whose SiLU and product are one Triton kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class TritonMergedGatedMLP(MergedGatedMLP):
    """Merged gate/up GEMM, then SiLU and product in one Triton kernel (strided halves).

    Where a GEMV plan serves the down projection with the Triton GEMV, two fusions (set by
    use_triton_ops, same results): `fuse_silu` makes SiLU-and-mul that GEMV's prologue (one
    kernel less, but every program recomputes the SiLU of its K slice); `fuse_split_k`,
    with defer_reduce and a K split, returns the unreduced `SplitKSum` for the next RMSNorm
    to reduce, add and norm in one kernel. Where the down projection takes no prologue
    (torch, the fused choice measured slower as at 64 rows, or `fuse_silu` off),
    `fuse_gate` computes SiLU-and-mul in the gate/up GEMV's epilogue instead, when the
    Triton GEMV serves that (`_gated`): each activation computed once, the [gate | up]
    output never written. Over several tensor-parallel ranks the down projection's output
    is reduced before the all-reduce (`MergedGatedMLP.forward`): `fuse_split_k` stays off.
    """

    fuse_silu = False
    fuse_split_k = False
    fuse_gate = False

    @property
    def gemv_fusion(self) -> str | None:
        """Which fusions are on ("silu+split_k", "silu", "split_k"; None): start-up selection
        times the down projection's candidates with them (gemv_timing.down_and_norm)."""
        parts = [
            name for name, on in (("silu", self.fuse_silu), ("split_k", self.fuse_split_k)) if on
        ]
        return "+".join(parts) or None

    def partial(self, x: torch.Tensor, defer_reduce: bool = False):
        down = self.down_proj
        plan = getattr(down, "gemv_plan", None)
        fusion = self.gemv_fusion
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        cfg = None
        if plan is not None and fusion is not None:
            cfg = plan.config_for(rows, *down.weight.shape, down.weight.dtype, fusion)
        defer = defer_reduce and self.fuse_split_k
        if cfg is not None and self.fuse_silu:
            return gemv(
                self.gate_up_proj(x), down.weight, down.bias, cfg, silu=True, defer_reduce=defer
            )
        act = self._gated(x, rows)  # SiLU-and-mul in the gate/up epilogue, or its own kernel
        if act is None:
            gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
            act = silu_and_mul(gate, up)
        if cfg is None:  # the plain choice; a K split of it still reduces in the next norm
            return dense(act, down.weight, down.bias, plan, defer)
        return gemv(act, down.weight, down.bias, cfg, defer_reduce=defer)

    def _gated(self, x: torch.Tensor, rows: int) -> torch.Tensor | None:
        """With `fuse_gate`, where the plan serves the gate/up projection with an unsplit
        matrix-unit tile: silu(gate) * up from that GEMV's epilogue (gemv `gated`), through
        `gated_config` of the chosen tile. None where not."""
        proj = self.gate_up_proj
        plan = getattr(proj, "gemv_plan", None)
        if not self.fuse_gate or plan is None:
            return None
        half = gated_config(plan.config_for(rows, *proj.weight.shape, proj.weight.dtype))
        if half is None:
            return None
        return gemv(x, proj.weight, proj.bias, half, gated=True)


_FUSED = {
    RMSNorm: TritonRMSNorm,
    RotaryEmbedding: TritonRotaryEmbedding,
    GatedMLP: TritonGatedMLP,
    MergedGatedMLP: TritonMergedGatedMLP,
}


def use_triton_ops(model: nn.Module, enable: bool = True, fuse: bool = True) -> int:
    """Switch (enable=False: switch back) the model's RMSNorm, rotary and gated-MLP modules to
    their Triton subclasses in place; returns how many modules changed. fuse: let merged
    MLPs fold SiLU-and-mul and the down projection's split-K pass into their neighbours
    where the Triton GEMV serves them, and attention blocks their output
    projection's split-K pass into the norm after them and rotary with the K/V store into
    their qkv projection's GEMV (same results, fewer kernels)."""
    mapping = _FUSED if enable else {v: k for k, v in _FUSED.items()}
    changed = 0
    for module in model.modules():
        new_class = mapping.get(type(module))
        if new_class is not None:
            module.__class__ = new_class
            changed += 1
        # Over several ranks a row-parallel output is all-reduced whole: no K split of it
        # is handed on unreduced.
        single = getattr(module, "tp", SINGLE_RANK).size == 1
        if isinstance(module, TritonMergedGatedMLP):
            module.fuse_silu = module.fuse_gate = fuse
            module.fuse_split_k = fuse and single
        elif isinstance(module, MergedGatedMLP):
            for name in ("fuse_silu", "fuse_split_k", "fuse_gate"):
                module.__dict__.pop(name, None)
        if hasattr(type(module), "split_k_to_norm"):  # attention: its output projection's
            module.split_k_to_norm = enable and fuse and single  # K split reduced in the norm
            module.rope_in_qkv = enable and fuse  # and rotary + K/V store in the qkv GEMV
    return changed
