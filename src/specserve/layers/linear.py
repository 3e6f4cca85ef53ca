"""Linear layers: one whose weight stacks several checkpoint projections along its rows, and
the switch (`use_gemv`) that routes decode-sized calls to the GEMV kernel measured fastest
for their shape on the device (`gemv_select.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from specserve.core.parallel import TensorSlice
    from specserve.kernels.gemv_plan import GemvPlan


class MergedLinear(nn.Linear):
    """nn.Linear over the row-wise concatenation of named projections (`shards`, name ->
    output rows, in order), e.g. q/k/v or gate/up: one GEMM instead of several.

    Checkpoints keep the separate tensors; the loader copies each into its row range
    (`shard_rows`), strictly, under the checkpoint's own names. Under tensor parallelism a
    rank holds some rows of each (column-parallel): `slices` names which rows of the
    checkpoint tensor (weight and bias alike); a projection absent there is held whole.
    """

    def __init__(
        self,
        in_features: int,
        shards: dict[str, int],
        bias: bool = False,
        slices: dict[str, TensorSlice | None] | None = None,
    ):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)
        self.slices = {k: v for k, v in (slices or {}).items() if v is not None}

    def shard_rows(self) -> dict[str, tuple[int, int]]:
        """Checkpoint projection name -> (first row, rows) in the merged weight."""
        out, start = {}, 0
        for name, rows in self.shards.items():
            out[name] = (start, rows)
            start += rows
        return out


def dense(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    plan: GemvPlan | None = None,
    defer_reduce: bool = False,
):
    """F.linear, through `plan`'s measured GEMV choice when one is installed. defer_reduce:
    where that choice splits K, return its partial sums unreduced (`gemv.SplitKSum`) for an
    RMSNorm with residual to reduce (triton_ops.TritonRMSNorm); only such a norm may read
    the result."""
    if plan is None:
        return F.linear(x, weight, bias)
    return plan.linear(x, weight, bias, defer_reduce)


class GemvLinear(nn.Linear):
    """nn.Linear whose calls go through a GEMV plan (`use_gemv`): decode-sized inputs to the
    kernel measured fastest for their shape, the rest to torch. Same parameters."""

    gemv_plan: GemvPlan | None = None

    def forward(self, x: torch.Tensor, defer_reduce: bool = False):
        return dense(x, self.weight, self.bias, self.gemv_plan, defer_reduce)


class GemvMergedLinear(MergedLinear):
    """MergedLinear through a GEMV plan, like GemvLinear."""

    gemv_plan: GemvPlan | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias, self.gemv_plan)


_GEMV = {nn.Linear: GemvLinear, MergedLinear: GemvMergedLinear}


def gemv_weights(model: nn.Module) -> dict[tuple[int, int, torch.dtype], list[torch.Tensor]]:
    """Every linear weight of the model grouped by (N, K, dtype), with the output projection
    a model computes its logits with (`lm_head_weight`, possibly the tied embedding)."""
    groups: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    if hasattr(model, "gemv_plan") and hasattr(model, "lm_head_weight"):
        weights.append(model.lm_head_weight)
    seen = set()
    for w in weights:
        if id(w) not in seen:
            seen.add(id(w))
            groups.setdefault((w.shape[0], w.shape[1], w.dtype), []).append(w.detach())
    return groups


# The fusion of a projection whose output goes straight into an add + RMSNorm (attention's
# o_proj): a K split's second pass runs inside that norm; its input is read as it is.
NORM_FUSION = "norm"


def fused_projections(model: nn.Module) -> dict[tuple[int, int, torch.dtype], str]:
    """(N, K, dtype) of each projection that fuses neighbours into its GEMV, with that
    fusion, set by triton_ops.use_triton_ops: a merged MLP's down projection (its
    `gemv_fusion`), an attention block's o_proj (NORM_FUSION, with `split_k_to_norm`). A
    shape both would claim keeps the down projection's fusion (o_proj then uses the plain
    choice)."""
    downs, outs = {}, {}
    for module in model.modules():
        fusion = getattr(module, "gemv_fusion", None)
        if fusion:
            w = module.down_proj.weight
            downs[(w.shape[0], w.shape[1], w.dtype)] = fusion
        if getattr(module, "split_k_to_norm", False):
            w = module.o_proj.weight
            outs[(w.shape[0], w.shape[1], w.dtype)] = NORM_FUSION
    return {**outs, **downs}


def gated_projections(model: nn.Module) -> set[tuple[int, int, torch.dtype]]:
    """(N, K, dtype) of each merged gate/up projection whose MLP may take SiLU-and-mul in
    its GEMV's epilogue (`fuse_gate`, set by triton_ops.use_triton_ops): selection compiles
    those variants with the others."""
    shapes = set()
    for module in model.modules():
        if getattr(module, "fuse_gate", False):
            w = module.gate_up_proj.weight
            shapes.add((w.shape[0], w.shape[1], w.dtype))
    return shapes


def linear_biases(model: nn.Module) -> dict[tuple[int, int, torch.dtype], torch.Tensor]:
    """A bias of each (N, K, dtype) whose linear layers have one (Qwen2's qkv): selection
    compiles those shapes' variants with a bias and checks cuBLAS's batch invariance with
    it (PyTorch runs a biased linear of one row another way than of several)."""
    biases = {}
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.bias is not None:
            biases.setdefault(
                (m.weight.shape[0], m.weight.shape[1], m.weight.dtype), m.bias.detach()
            )
    return biases


def rope_projections(model: nn.Module) -> dict[tuple[int, int, torch.dtype], tuple[int, int, int]]:
    """(N, K, dtype) of each qkv projection whose attention block may run rotary and the K/V
    store in its GEMV's epilogue (`rope_in_qkv`, set by triton_ops.use_triton_ops), with its
    (q heads, kv heads, head dim): selection compiles those variants with the others."""
    shapes = {}
    for module in model.modules():
        if getattr(module, "rope_in_qkv", False) and getattr(module, "q_norm", None) is None:
            w = module.qkv_proj.weight
            shapes[(w.shape[0], w.shape[1], w.dtype)] = (
                module.num_heads,
                module.num_kv_heads,
                module.head_dim,
            )
    return shapes


def install_gemv_plan(model: nn.Module, plan: GemvPlan | None, enable: bool = True) -> None:
    """Route the model's linear layers (and its logits projection, for models with a
    `gemv_plan` attribute) through `plan` (tuning/gemv_select.py's `use_gemv` measures one);
    enable=False switches back to plain torch."""
    mapping = _GEMV if enable else {v: k for k, v in _GEMV.items()}
    for module in model.modules():
        new_class = mapping.get(type(module))
        if new_class is not None:
            module.__class__ = new_class
        if isinstance(module, (GemvLinear, GemvMergedLinear)):
            module.gemv_plan = plan if enable else None
    if hasattr(model, "gemv_plan"):
        model.gemv_plan = plan if enable else None
