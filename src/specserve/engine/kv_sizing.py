"""How many KV pages an engine gets: an explicit count or byte budget, else a fraction of the
device memory free after loading, less what the drafter and the CUDA graphs' outputs need."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch

from specserve.core.config import EngineConfig
from specserve.core.errors import ConfigError, drafter_errors
from specserve.core.model_config import ModelConfig

log = logging.getLogger("specserve")
CPU_KV_CACHE_BYTES = 256 * 2**20


def kv_cache_pages(
    config: EngineConfig,
    model_cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    kv_cfg: ModelConfig | None = None,
) -> int:
    """Pages of the target's KV cache (the drafter's pool, if any, gets as many).

    `num_kv_pages` when given, else what `kv_cache_bytes` buys; without either, on CUDA
    `kv_cache_memory_fraction` of the device memory free now (the target's weights are
    loaded), less the drafter's weights, divided by the bytes a page costs in the target's
    and the drafter's pools together; the rest is left to CUDA graphs and activations. It is
    capped at what max_num_seqs sequences of full context could use (small models).
    Elsewhere 256 MiB. A byte budget holds the drafter's pool too. The size is logged.
    `kv_cfg`: the shape of this rank's KV heads under tensor parallelism (the drafter and
    the graphs' outputs are whole on every rank)."""
    page_bytes = config.cache.page_size * (kv_cfg or model_cfg).kv_bytes_per_token(dtype)
    if config.cache.num_pages is not None:
        pages, source = config.cache.num_pages, "num_kv_pages"
    elif config.cache.size_bytes is not None or device.type != "cuda":
        # (the drafter's pool, as many pages, within the same budget)
        drafter_page_bytes = config.cache.page_size * _drafter_needs(config, model_cfg, dtype)[0]
        budget = config.cache.size_bytes or CPU_KV_CACHE_BYTES
        pages = budget // (page_bytes + drafter_page_bytes)
        source = f"a budget of {budget / 2**30:.2f} GiB"
        if drafter_page_bytes:
            source += f", drafter KV {pages * drafter_page_bytes / 2**30:.2f} GiB of it"
    else:
        drafter_token_bytes, drafter_weight_bytes = _drafter_needs(config, model_cfg, dtype)
        gc.collect()  # engines that are gone but not yet collected still hold their pools
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        # Memory PyTorch's allocator holds but no tensor uses (a previous engine's) is free too.
        free_bytes += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        graph_bytes = graph_output_bytes(config, model_cfg, dtype)
        budget = int(config.cache.memory_fraction * free_bytes) - drafter_weight_bytes - graph_bytes
        per_page = page_bytes + config.cache.page_size * drafter_token_bytes
        # No more than every sequence at full context (plus its draft lookahead) can use.
        max_len = min(
            config.scheduler.max_model_len or model_cfg.max_position_embeddings,
            model_cfg.max_position_embeddings,
        )
        lookahead = 2 * (config.speculative.num_steps + 1) if config.speculative.algorithm else 2
        usable = (
            config.scheduler.max_num_seqs * -(-(max_len + lookahead) // config.cache.page_size) + 1
        )
        pages = min(max(budget, 0) // per_page, usable)
        one_sequence = -(-(max_len + lookahead) // config.cache.page_size) + 1
        if pages < one_sequence:
            raise ConfigError(
                f"the GPU has {free_bytes / 2**30:.2f} of {total_bytes / 2**30:.1f} GiB free "
                f"after loading the weights; {config.cache.memory_fraction:.2f} of it buys "
                f"{pages} KV pages, fewer than one {max_len}-token sequence needs "
                f"({one_sequence}). Free GPU memory (another engine in this process?), raise "
                "--kv-cache-memory-fraction, lower --max-model-len, or set --kv-cache-bytes "
                "or --num-kv-pages"
            )
        source = (
            f"{config.cache.memory_fraction:.2f} of {free_bytes / 2**30:.1f} GiB free "
            f"(of {total_bytes / 2**30:.1f} GiB), at most {usable} pages usable, drafter "
            f"weights {drafter_weight_bytes / 2**30:.2f} GiB, CUDA graphs' outputs "
            f"{graph_bytes / 2**30:.2f} GiB, drafter KV "
            f"{pages * config.cache.page_size * drafter_token_bytes / 2**30:.2f} GiB"
        )
    log.info(
        "KV cache: %d pages of %d tokens, %d tokens, %.2f GiB (%s)",
        pages,
        config.cache.page_size,
        pages * config.cache.page_size,
        pages * page_bytes / 2**30,
        source,
    )
    return pages


def graph_output_bytes(config: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype) -> int:
    """What the target's CUDA graphs keep alive between replays: every graph's outputs (its
    logits, final and auxiliary hidden states, greedy tokens), one set per (batch bucket,
    tokens per request), all in one pool: 6.3 GB for the 8B shape at K=3 and 256 requests,
    13.3 GB at K=5. 0 without graphs."""
    if config.execution.disable_cuda_graph:
        return 0
    from specserve.runtime.graph_shapes import engine_graph_shapes, engine_mixed_shapes, mixed_keys

    buckets, q_lens = engine_graph_shapes(config)
    rows = sum(buckets) * sum(q_lens)
    aux = 3 if config.speculative.algorithm == "eagle3" else 0  # EAGLE-3's captured layers
    per_row = (model_cfg.vocab_size + (1 + aux) * model_cfg.hidden_size) * dtype.itemsize + 16
    # mixed steps' graphs keep their final hidden states only (aux too without EAGLE-3's
    # in-graph feature store, but only EAGLE-3 asks for aux)
    mixed_rows = sum(t for _, t in mixed_keys(*engine_mixed_shapes(config)))
    return rows * per_row + mixed_rows * model_cfg.hidden_size * dtype.itemsize


def _drafter_needs(
    config: EngineConfig, target: ModelConfig, dtype: torch.dtype
) -> tuple[int, int]:
    """(KV bytes per token, weight bytes) of the configured drafter, before it is loaded;
    weights estimated from its safetensors files (at most the loaded size when it keeps or
    narrows their dtype), or from its shape when its weights are random (--load-format
    dummy)."""
    algo, path = config.speculative.algorithm, config.speculative.draft_model_path
    dummy = config.load.format == "dummy"
    if algo not in ("draft", "eagle3") or (path is None and not dummy):
        return 0, 0
    if algo == "eagle3":
        from specserve.model.eagle3_config import Eagle3Config

        if path is None:  # a random head of the target's shape (model/dummy.py)
            from specserve.model.dummy import dummy_eagle3_config
            from specserve.model.eagle3 import Eagle3Head

            head_cfg = dummy_eagle3_config(target)
            with torch.device("meta"):
                head = Eagle3Head(head_cfg, head_cfg.aux_layer_ids(target.num_layers))
            layer = head_cfg.layer
            weight_bytes = sum(p.numel() for p in head.parameters()) * dtype.itemsize
        else:
            with drafter_errors(path):
                layer = Eagle3Config.load(path).layer
            weight_bytes = _file_bytes(Path(path), "*.safetensors")
        # Its KV plus its feature store (one projected target feature per KV slot).
        return layer.kv_bytes_per_token(dtype) + layer.hidden_size * dtype.itemsize, weight_bytes
    from specserve.model.loader import load_config, resolve_model

    source = resolve_model(path, config.load.format, "speculative_draft_model_path")
    with drafter_errors(path):
        draft_cfg = load_config(source)
    kv_token_bytes = draft_cfg.kv_bytes_per_token(dtype)
    if source.kind == "dummy":
        weights = draft_cfg.hidden_size * (
            2 * draft_cfg.vocab_size
            + draft_cfg.num_layers
            * (
                2 * draft_cfg.num_heads * draft_cfg.head_dim
                + 2 * draft_cfg.num_kv_heads * draft_cfg.head_dim
                + 3 * draft_cfg.intermediate_size
            )
        )
        return kv_token_bytes, weights * dtype.itemsize
    if source.kind == "gguf":  # quantized on disk: about 4 bits a weight, 16 once loaded
        return kv_token_bytes, 4 * source.path.stat().st_size
    return kv_token_bytes, _file_bytes(source.path, "*.safetensors")


def _file_bytes(folder: Path, pattern: str) -> int:
    return sum(f.stat().st_size for f in folder.glob(pattern) if f.is_file())
