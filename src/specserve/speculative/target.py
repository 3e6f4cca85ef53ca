"""What speculation is built from: the engine's configuration and the target's parts, handed
down explicitly (the speculation floor never sees the engine above it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.core.config import EngineConfig
from specserve.core.kv_cache import KVCache
from specserve.core.model_config import ModelConfig
from specserve.runtime.model_runner import ModelRunner


@dataclass(frozen=True)
class TargetParts:
    """The target a proposer drafts for and a policy times: its config and dtype, its KV
    cache (whose pages a drafter shares), its runner (model, attention backend, graphs),
    the context limit, and the GEMV selector whose measurements a drafter reuses (None:
    no GEMV selection)."""

    config: EngineConfig
    model_config: ModelConfig
    dtype: torch.dtype
    kv: KVCache
    runner: ModelRunner
    max_model_len: int
    gemv_selector: object | None = None
