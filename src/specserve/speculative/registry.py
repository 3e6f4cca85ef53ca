"""Build the proposer an EngineConfig asks for."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from specserve.core.config import EngineConfig
from specserve.core.errors import drafter_errors
from specserve.core.model_config import ModelConfig
from specserve.speculative.proposer import Proposer

if TYPE_CHECKING:
    from specserve.speculative.target import TargetParts


def build_proposer(target: TargetParts) -> Proposer:
    """The proposer of `target.config.speculative.algorithm`, sharing the target's pages."""
    cfg = target.config
    algo = cfg.speculative.algorithm
    if algo == "ngram":
        from specserve.speculative.ngram import NgramProposer

        return NgramProposer()
    if algo == "draft":
        from specserve.core.kv_cache import KVCache
        from specserve.model.loader import load_config, load_model, resolve_model
        from specserve.speculative.draft_model import DraftModelProposer

        source = resolve_model(
            cfg.speculative.draft_model_path, cfg.load.format, "speculative_draft_model_path"
        )
        path = cfg.speculative.draft_model_path
        with drafter_errors(path):
            draft_cfg = load_config(source)  # (its fit to the target: `check_drafter`)
        # Drafts run at the target's positions: a draft of a shorter context (or a sliding
        # window, which cuts it) gets rotary to the target's (every draft is verified).
        positions = max(
            draft_cfg.max_position_embeddings, target.model_config.max_position_embeddings
        )
        draft_cfg = replace(draft_cfg, max_position_embeddings=positions)
        device = target.kv.pool.device
        with drafter_errors(path):
            model = load_model(
                source, target.dtype, device, config=draft_cfg, seed=cfg.load.seed + 1
            )
        kv = KVCache(
            draft_cfg, target.kv.allocator.num_pages, cfg.cache.page_size, target.dtype, device
        )
        if device.type == "cuda":  # its own head layout's attention variants, before serving
            target.runner.backend.warm_up(draft_cfg.num_heads, kv.layers[0])
        proposer = DraftModelProposer(
            model, kv, target.runner.backend, target.model_config.vocab_size
        )
        proposer.max_pass_tokens = cfg.scheduler.max_num_batched_tokens
        return proposer
    if algo == "eagle3":
        from specserve.speculative.eagle3 import build_eagle3_proposer

        return build_eagle3_proposer(target)
    raise ValueError(f"unknown speculative algorithm {algo!r}")


def check_drafter(config: EngineConfig, target_config: ModelConfig, tokenizer) -> None:
    """Refuse a drafter made for another target from the configs and tokenizers alone, before
    either model's weights load (a 70B target takes minutes): a draft model whose tokenizer
    is not the target's `tokenizer` (or, without one, whose vocabulary size differs), an
    EAGLE-3 head of another vocabulary or hidden size. Errors name the flag."""
    spec = config.speculative
    path = spec.draft_model_path
    if path is None or spec.algorithm not in ("draft", "eagle3"):
        return
    from specserve.model.loader import load_config, resolve_model

    if spec.algorithm == "eagle3":
        from specserve.model.eagle3 import check_head_fits
        from specserve.model.eagle3_config import Eagle3Config

        with drafter_errors(path):
            check_head_fits(Eagle3Config.load(path), path, target_config)
        return
    from specserve.speculative.draft_model import check_tokenizers

    # (a path that is no model names its flag itself)
    source = resolve_model(path, config.load.format, "speculative_draft_model_path")
    with drafter_errors(path):
        draft_cfg = load_config(source)
        check_tokenizers(
            draft_tokenizer(source), tokenizer, draft_cfg.vocab_size, target_config.vocab_size
        )


def draft_tokenizer(source):
    """A draft model's tokenizer, or None where its folder has none specserve can read (a
    random-weight shape without a tokenizer folder included): taken on its vocabulary size."""
    from specserve.core.errors import CheckpointError
    from specserve.model.loader import load_tokenizer

    if source.kind == "dummy":
        from specserve.model.dummy import tokenizer_folder

        if tokenizer_folder(str(source.path)) is None:
            return None
    elif source.kind == "hf" and not any(
        (source.path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return None
    try:
        return load_tokenizer(source)
    except (CheckpointError, ValueError, OSError, TypeError, KeyError):
        return None
