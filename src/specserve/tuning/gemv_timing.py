"""How start-up selection times a GEMV candidate: `time_in_graph_us` replays a CUDA graph of
calls over weights of one shape that together overflow L2 (`rotation_set`), as the engine
runs them; each call reads what a small kernel wrote just before it (`after_producer`), as
every decode projection does in the model; the down projection of an MLP with fused
neighbours is timed together with them (`down_and_norm`), since what its fusions save are
kernels around the GEMV."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.core.graph_timing import no_collection_while_capturing, replay_ms
from specserve.kernels.gemv import GemvConfig, SplitKSum, gemv
from specserve.layers.linear import NORM_FUSION

NORM_EPS = 1e-5  # the timed norm's; any value times alike


def time_in_graph_us(fn, x: torch.Tensor, weights: list[torch.Tensor], reps: int = 5) -> float:
    """Median device time of one `fn(x, w)` call, from `reps` replays of a CUDA graph that
    calls it once per weight. `fn` must have run eagerly once (compilation, cuBLAS set-up)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), no_collection_while_capturing():
        graph.capture_begin()
        for w in weights:
            fn(x, w)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    return replay_ms(graph, reps) * 1000 / len(weights)


def after_producer(fn, x: torch.Tensor):
    """fn(x, w) with a small kernel before it that writes the input the call reads: the
    Triton RMSNorm of x into a buffer (launched under PDL, as the model's norms are).

    In the model every decode projection reads what a small kernel has just written (an
    RMSNorm, attention's split merge, SiLU-and-mul), so timed this way a candidate meets
    the kernel boundary it meets there. Timed back to back instead, a configuration of many
    short programs overlaps the tail of its own previous call and ranks better than it runs
    between its neighbours: on the H200 at batch 1 the 8B qkv projection's back-to-back
    winner was ~2 us a layer slower in a layer's chain than another tile, and cuBLAS's
    gate_up ~1.5 us slower than a Triton tile.

    The norm spans the input's full width (a fused down projection's [gate | up] rows too)
    and is in every timing, torch's included: times (and the plan summary's speed-ups) are
    of norm + projection, not comparable with those measured before this rule."""
    from specserve.kernels.triton_norm import rms_norm  # a kernel module: imported when used

    buf = torch.empty_like(x)
    ones = torch.ones(x.shape[-1], device=x.device, dtype=x.dtype)

    def run(x: torch.Tensor, w: torch.Tensor):
        return fn(rms_norm(x, ones, NORM_EPS, out=buf), w)

    return run


def rotation_set(
    weights: list[torch.Tensor], min_bytes: int, min_calls: int = 4, max_calls: int = 256
) -> list[torch.Tensor]:
    """Weights of one shape to call in turn when timing: distinct ones (the model's own, then
    clones) until together they exceed `min_bytes`, so that they stream from memory, not
    from L2; then repeats up to `min_calls`, so a graph's launch cost is spread out."""
    out: list[torch.Tensor] = []
    total = 0
    while total < min_bytes and len(out) < max_calls:
        i = len(out)
        w = weights[i] if i < len(weights) else weights[i % len(weights)].clone()
        out.append(w)
        total += w.numel() * w.element_size()
    distinct = len(out)
    while len(out) < min_calls:
        out.append(out[len(out) % distinct])
    return out


def torch_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def fused_input_cols(k: int, fusion: str) -> int:
    """Columns of the input a fused projection of a weight [N, k] reads: a merged MLP's
    down projection its [gate | up] rows, attention's o_proj (NORM_FUSION) its own."""
    return k if fusion == NORM_FUSION else 2 * k


def down_and_norm(
    cfg: GemvConfig | None,
    fusion: str,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    unfused: GemvConfig | None = None,
):
    """fn(x, w): a projection and the add + RMSNorm after it, as the model runs them. A
    merged MLP's down projection (triton_ops.TritonMergedGatedMLP) from its gate_up output:
    with cfg, the Triton GEMV with the parts of `fusion` ("silu": SiLU-and-mul as its
    prologue, "split_k": its split-K pass inside the norm); cfg None: unfused, SiLU-and-mul,
    then the shape's plain choice (`unfused`: a Triton GEMV, None: cuBLAS), then add +
    RMSNorm (which runs a K split's pass of `unfused` with "split_k", as the model does).
    Attention's o_proj (fusion NORM_FUSION, llama.Attention): the same without SiLU, its
    split-K pass always in the norm. Where the model would compute SiLU-and-mul in the
    gate/up GEMV's epilogue instead (triton_ops `fuse_gate`, decided by gate/up's own
    choice), the unfused path here still pays the separate kernel: selection leans toward
    the prologue there, and whole-step tuning (tuning/plan_tuning.py) settles it."""
    from specserve.layers.triton_ops import add_rms_norm, silu_and_mul, split_k_add_rms_norm

    silu = cfg is not None and "silu" in fusion
    gated = fusion != NORM_FUSION
    defer = "split_k" in fusion or not gated

    def run(x: torch.Tensor, w: torch.Tensor):
        k = w.shape[1]
        a = x if silu or not gated else silu_and_mul(x[:, :k], x[:, k:])
        if cfg is not None:
            y = gemv(a, w, None, cfg, silu=silu, defer_reduce=defer)
        elif unfused is not None:  # the model defers a split of it to the norm, too
            y = gemv(a, w, None, unfused, defer_reduce=defer)
        else:
            y = F.linear(a, w)
        if isinstance(y, SplitKSum):
            return split_k_add_rms_norm(y, residual, norm_weight, NORM_EPS)
        return add_rms_norm(y, residual, norm_weight, NORM_EPS)

    return run
