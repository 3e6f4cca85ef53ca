"""The config of an EAGLE-3 draft head (public layout), validated; see model/eagle3.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specserve.core.errors import CheckpointError, UnsupportedModelError
from specserve.core.model_config import ModelConfig, RopeFreqFactors, config_from_dict

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """Input of target layers [2, L//2, L-3], as EAGLE-3 servers capture by default."""
    n = num_target_layers
    return (2, n // 2, n - 3)


def check_aux_layer_ids(ids, num_target_layers: int) -> None:
    """UnsupportedModelError unless `ids` are three different layers of the target whose
    input a head can read (1 .. L-1: the file names each by the layer before it). Said in
    these ids: the file's, one less, would confuse whoever typed them."""
    last = num_target_layers - 1
    if len(ids) != 3 or len(set(ids)) != 3 or not all(1 <= i <= last for i in ids):
        raise UnsupportedModelError(
            f"auxiliary layer ids {list(ids)} must be three different target layers in "
            f"[1, {last}]: the head reads each one's input, the output of the layer before it"
        )


@dataclass(frozen=True)
class Eagle3Config:
    """The shape of an EAGLE-3 head, read from (and written to) its config.json.

    `layer` holds the normalized Llama fields of the single decoder layer (its vocab_size is
    the target's vocabulary). `file_aux_layer_ids` is the file's
    eagle_aux_hidden_state_layer_ids (public convention: outputs of those layers), or None.
    `norm_before_residual`: the layer's residual stream starts from the normed hidden state
    (the file's key of that name, as vLLM and SGLang read it), else from the hidden state.
    """

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    file_aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.draft_vocab_size <= self.layer.vocab_size:
            raise CheckpointError(
                f"draft_vocab_size ({self.draft_vocab_size}) must lie in "
                f"[1, vocab_size={self.layer.vocab_size}]"
            )
        if self.target_hidden_size < 1:
            raise CheckpointError(f"target_hidden_size must be >= 1; got {self.target_hidden_size}")
        ids = self.file_aux_layer_ids
        if ids is not None and (len(ids) != 3 or min(ids) < 0):
            raise UnsupportedModelError(
                "eagle_aux_hidden_state_layer_ids must list three non-negative target layer "
                f"ids (low, mid, high); got {list(ids)}"
            )

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    def aux_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """Target layers whose input residual stream the head reads, checked against L."""
        if self.file_aux_layer_ids is None:
            ids = default_aux_layer_ids(num_target_layers)
        else:
            ids = tuple(i + 1 for i in self.file_aux_layer_ids)
        if len(set(ids)) != 3 or not all(0 <= i < num_target_layers for i in ids):
            raise UnsupportedModelError(
                f"auxiliary layers (inputs of target layers {list(ids)}) do not fit a target of "
                f"{num_target_layers} layers; set eagle_config.eagle_aux_hidden_state_layer_ids"
            )
        return ids

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        draft_vocab_size: int,
        aux_layer_ids: tuple[int, ...] | None = None,
    ) -> Eagle3Config:
        """A head shaped like one layer of `target`. `aux_layer_ids` are input-layer ids
        (None: the default); the file records them only when they differ from the default."""
        # A GGUF target's per-frequency factors have no config.json form: the head's own
        # rotary is plain (it is trained and served with what its file says).
        scaling = None if isinstance(target.rope_scaling, RopeFreqFactors) else target.rope_scaling
        layer = replace(
            target,
            num_layers=1,
            tie_word_embeddings=False,
            qkv_bias=False,
            qk_norm=False,
            rope_scaling=scaling,
        )
        file_ids = None
        if aux_layer_ids is not None:
            check_aux_layer_ids(aux_layer_ids, target.num_layers)
        if aux_layer_ids is not None and tuple(aux_layer_ids) != default_aux_layer_ids(
            target.num_layers
        ):
            file_ids = tuple(i - 1 for i in aux_layer_ids)
        cfg = cls(layer, draft_vocab_size, target.hidden_size, file_ids)
        cfg.aux_layer_ids(target.num_layers)  # validates against the target
        return cfg

    @classmethod
    def from_dict(cls, raw: dict) -> Eagle3Config:
        archs = raw.get("architectures") or []
        if ARCHITECTURE not in archs:
            raise UnsupportedModelError(
                f"architectures {archs!r} is not an EAGLE-3 head; expected [{ARCHITECTURE!r}]"
            )
        layer = config_from_dict(
            {
                **raw,
                "architectures": ["LlamaForCausalLM"],
                "num_hidden_layers": 1,
                "tie_word_embeddings": False,
            }
        )
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        try:
            return cls(
                layer=layer,
                draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
                target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
                file_aux_layer_ids=None if ids is None else tuple(int(i) for i in ids),
                norm_before_residual=bool(raw.get("norm_before_residual", False)),
            )
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"EAGLE-3 config.json has a malformed field: {e}") from None

    @classmethod
    def load(cls, folder: str | Path) -> Eagle3Config:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path} does not exist; an EAGLE-3 head folder needs one")
        try:
            raw = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path} is not a JSON object")
        return cls.from_dict(raw)

    def to_dict(self, dtype: torch.dtype | None = None) -> dict:
        c = self.layer
        raw = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": c.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
        }
        if c.rope_scaling is not None:
            s = c.rope_scaling
            raw["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        if self.file_aux_layer_ids is not None:
            raw["eagle_config"] = {
                "eagle_aux_hidden_state_layer_ids": list(self.file_aux_layer_ids),
                "use_aux_hidden_state": True,
            }
        if self.norm_before_residual:
            raw["norm_before_residual"] = True
        if dtype is not None:
            raw["torch_dtype"] = str(dtype).replace("torch.", "")
        return raw
