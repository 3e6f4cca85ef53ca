"""Build the proposer an EngineConfig asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specserve.spec.proposer import Proposer

if TYPE_CHECKING:
    from specserve.engine.engine import LLMEngine


def build_proposer(engine: LLMEngine) -> Proposer:
    """The proposer of `engine.config.speculative_algorithm`, sharing the target's pages."""
    cfg = engine.config
    algo = cfg.speculative_algorithm
    if algo == "ngram":
        from specserve.spec.ngram import NgramProposer

        return NgramProposer()
    if algo == "draft":
        from specserve.engine.kv_cache import KVCache
        from specserve.model.loader import load_config, load_model, resolve_model
        from specserve.spec.draft_model import DraftModelProposer

        source = resolve_model(cfg.speculative_draft_model_path, cfg.load_format)
        draft_cfg = load_config(source)
        device = engine.kv.pool.device
        model = load_model(source, engine.dtype, device, config=draft_cfg, seed=cfg.seed + 1)
        kv = KVCache(draft_cfg, engine.kv.allocator.num_pages, cfg.page_size, engine.dtype, device)
        if device.type == "cuda":  # its own head layout's attention variants, before serving
            engine.runner.backend.warm_up(draft_cfg.num_heads, kv.layers[0])
        proposer = DraftModelProposer(model, kv, engine.runner.backend,
                                      engine.model_config.vocab_size)  # fmt: skip
        proposer.max_pass_tokens = cfg.max_num_batched_tokens
        return proposer
    if algo == "eagle3":
        from specserve.spec.eagle3 import build_eagle3_proposer

        return build_eagle3_proposer(engine)
    raise ValueError(f"unknown speculative algorithm {algo!r}")
