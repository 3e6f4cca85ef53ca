"""Tensor-parallel model cases: the steps every model runs (a prefill of two prompts, then
decode steps) and what each rank of a gloo group reports for every case at every size it
belongs to (`rank_results`, run through tests/support/distributed.py). The test process
runs the same steps unsharded and through transformers to compare."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.core.kv_cache import KVCache
from specserve.core.model_config import ModelConfig
from specserve.layers.attention import TorchAttentionBackend
from specserve.model.loader import ModelSource, load_model
from tests.support.model_cases import build_meta

PAGE_SIZE = 4
PROMPTS = [[5, 17, 33, 80, 120, 7, 9], [200, 11, 382, 1]]
DECODE = [[42, 300], [381, 0], [99, 250]]  # a token per request per decode step
EMBED_IDS = torch.tensor([0, 1, 95, 96, 127, 128, 191, 192, 290, 381, 382])
DUMMY_SEED = 3


@dataclass(frozen=True)
class Case:
    """A checkpoint and the tensor-parallel sizes it runs at."""

    name: str
    source: ModelSource
    sizes: tuple[int, ...]


def sequences() -> list[list[int]]:
    """Each request's whole token sequence over the steps."""
    return [p + [step[i] for step in DECODE] for i, p in enumerate(PROMPTS)]


def step_logits(model) -> list[torch.Tensor]:
    """fp32 logits of every token of the prefill step and of each decode step, over a KV
    cache sized from the model's `kv_config` (this rank's KV heads)."""
    lens = [len(p) for p in PROMPTS]
    pages = -(-(max(lens) + len(DECODE)) // PAGE_SIZE)
    kv = KVCache(model.kv_config, 1 + pages * len(PROMPTS), PAGE_SIZE, torch.float32, "cpu")
    tables = [kv.allocator.allocate(pages) for _ in PROMPTS]
    backend = TorchAttentionBackend()
    steps = [(torch.tensor(sum(PROMPTS, [])), [0] * len(lens), lens)]
    for tokens in DECODE:
        starts = steps[-1][2]
        steps.append((torch.tensor(tokens), starts, [s + 1 for s in starts]))
    out = []
    with torch.inference_mode():
        for ids, starts, ends in steps:
            meta = build_meta(tables, starts, ends, PAGE_SIZE, "cpu")
            hidden, _ = model(ids, meta, kv.layers, backend)
            out.append(model.compute_logits(hidden))
    return out


def load(case: Case, tp=None):
    from specserve.core.parallel import SINGLE_RANK

    return load_model(
        case.source, torch.float32, torch.device("cpu"), seed=DUMMY_SEED, tp=tp or SINGLE_RANK
    )


def _error(build) -> str:
    from specserve.core.errors import ConfigError

    try:
        build()
    except ConfigError as e:
        return str(e)
    return ""


def _shape_errors(tp) -> dict[str, str]:
    """The messages of models whose shape this group cannot split (built on meta)."""
    from dataclasses import replace

    from specserve.model.llama import LlamaForCausalLM

    base = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=72,
        intermediate_size=96,
        num_layers=1,
        num_heads=12,
        num_kv_heads=6,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    shapes = {
        "heads": replace(base, num_heads=9, num_kv_heads=3),
        "kv_heads": base,
        "kv_replicas": replace(base, num_kv_heads=2),
        "intermediate": replace(base, intermediate_size=90, num_kv_heads=12),
    }
    with torch.device("meta"):
        return {k: _error(lambda c=c: LlamaForCausalLM(c, tp)) for k, c in shapes.items()}


def rank_results(cases: list[Case]) -> dict:
    """On each rank: for every size and every case run at it, this rank's step logits, head
    counts, full embeddings of EMBED_IDS and (dummy weights) its shards of a few weights;
    and the shape errors at each size."""
    from tests.support.distributed import tensor_parallel_groups

    groups = tensor_parallel_groups(sorted({s for c in cases for s in c.sizes} | {2, 4}))
    out = {}
    for size, tp in groups.items():
        if tp is None:
            continue
        out[f"errors/{size}"] = _shape_errors(tp)
        for case in cases:
            if size not in case.sizes:
                continue
            model = load(case, tp)
            layer = model.model.layers[0]
            result = {
                "logits": step_logits(model),
                "heads": (model.num_heads, model.num_kv_heads, model.kv_config.num_kv_heads),
                "embed": model.model.embed_tokens(EMBED_IDS),
            }
            if case.source.kind == "dummy":
                result["weights"] = {
                    "embed": model.model.embed_tokens.weight,
                    "qkv": layer.self_attn.qkv_proj.weight,
                    "o_proj": layer.self_attn.o_proj.weight,
                    "gate_up": layer.mlp.gate_up_proj.weight,
                    "down": layer.mlp.down_proj.weight,
                }
            out[f"{case.name}/{size}"] = result
    return out


def head_steps(head) -> dict:
    """An EAGLE-3 head (serving form) over a prefill of two requests' tokens and a decode
    step, on its KV cache sized from `kv_config` (this rank's KV heads): its outputs, fp32
    logits and greedy draft ids at each step. Inputs are seeded: the same on every rank."""
    h = head.config.layer.hidden_size
    gen = torch.Generator().manual_seed(11)
    lens = [len(p) for p in PROMPTS]
    pages = -(-(max(lens) + 1) // PAGE_SIZE)
    kv = KVCache(head.kv_config, 1 + pages * len(PROMPTS), PAGE_SIZE, torch.float32, "cpu")
    tables = [kv.allocator.allocate(pages) for _ in PROMPTS]
    backend = TorchAttentionBackend()
    out = {"heads": (head.midlayer.self_attn.num_heads, head.kv_config.num_kv_heads)}
    steps = [([0] * len(lens), lens), (lens, [n + 1 for n in lens])]
    with torch.inference_mode():
        for i, (starts, ends) in enumerate(steps):
            t = sum(e - s for s, e in zip(starts, ends))
            embeds, hidden = torch.randn(t, h, generator=gen), torch.randn(t, h, generator=gen)
            meta = build_meta(tables, starts, ends, PAGE_SIZE, "cpu")
            y = head(embeds, hidden, meta, kv.layers[0], backend)
            out[f"out/{i}"] = y
            out[f"logits/{i}"] = head.compute_logits(y)
            out[f"greedy/{i}"] = head.greedy(y)
    return out


def head_results(folder: str, target: ModelConfig) -> dict:
    """On each rank of a group of two: `head_steps` of the EAGLE-3 head in `folder` and of
    a random head of the target's shape (seed DUMMY_SEED), each loaded or built as this
    rank's shard."""
    from specserve.model.dummy import build_dummy_eagle3_head
    from specserve.model.eagle3 import load_eagle3_head
    from tests.support.distributed import tensor_parallel_groups

    tp = tensor_parallel_groups([2])[2]
    cpu = torch.device("cpu")
    loaded = load_eagle3_head(folder, target, torch.float32, cpu, tp).merge_projections()
    dummy = build_dummy_eagle3_head(target, torch.float32, cpu, DUMMY_SEED, tp)
    return {"loaded": head_steps(loaded), "dummy": head_steps(dummy.merge_projections())}
