"""Normalize Hugging Face and GGUF configs into one ModelConfig, so models never see quirks."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve.core.errors import CheckpointError, UnsupportedModelError

log = logging.getLogger(__name__)

# architecture name -> (qkv bias, q/k norm)
_FAMILIES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
_DTYPE_NAMES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (rope_type 'llama3')."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class RopeFreqFactors:
    """Per-frequency divisors of the inverse frequencies (a GGUF's `rope_freqs` tensor:
    llama.cpp's form of Llama 3.1's scaling, one factor a rotary pair)."""

    factors: tuple[float, ...]


@dataclass(frozen=True)
class ModelConfig:
    """The shape and numerics of a Llama-family decoder, independent of checkpoint format."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | RopeFreqFactors | None = None
    # Mistral-style sliding-window attention: the context is cut to the window, where full
    # attention is exact (`sliding_window_of`)
    sliding_window: int | None = None
    dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token over all layers."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(raw: dict) -> tuple[float, RopeScaling | None]:
    """rope_theta and llama3 scaling from 4.x keys (rope_theta, rope_scaling) or 5.x
    (rope_parameters)."""
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported (supported: default, llama3)"
        )
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def sliding_window_of(arch: str, raw: dict, num_layers: int) -> int | None:
    """The attention window some layers keep, as transformers reads the config, or None.

    Mistral windows every layer (4,096 tokens where the key is missing, as transformers'
    MistralConfig defaults); Qwen2 and Qwen3 window the layers from `max_window_layers` on,
    only with `use_sliding_window`; a `layer_types` list says it per layer."""
    window = raw.get("sliding_window", 4096 if arch == "MistralForCausalLM" else None)
    if window is None:
        return None
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if arch == "MistralForCausalLM":
        return int(window)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and raw.get("use_sliding_window"):
        first = int(raw.get("max_window_layers", 28))
        return int(window) if first < num_layers else None
    return None


def _check_features(arch: str, raw: dict) -> None:
    """Refuse config fields whose model specserve would run wrongly, naming the field."""
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(
            f"hidden_act {act!r} is not supported: specserve's MLP is SiLU-gated (silu)"
        )
    if raw.get("mlp_bias") and arch == "LlamaForCausalLM":
        raise UnsupportedModelError("mlp_bias: true (biases in the MLP) is not supported")
    if raw.get("attention_bias") and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        raise UnsupportedModelError(
            "attention_bias: true (biases on q/k/v and the attention's output projection) "
            "is not supported"
        )


def config_from_dict(raw: dict) -> ModelConfig:
    """Build a ModelConfig from the contents of a Hugging Face config.json."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in _FAMILIES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {archs or raw.get('model_type')!r} is not supported; "
            f"specserve serves {', '.join(sorted(_FAMILIES))}"
        )
    _check_features(arch, raw)
    qkv_bias, qk_norm = _FAMILIES[arch]
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        theta, scaling = _rope(raw)
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        layers = int(raw["num_hidden_layers"])
        context = int(raw.get("max_position_embeddings", 4096))
        window = sliding_window_of(arch, raw, layers)
        if window is not None and window < context:
            # Within the window, windowed attention is full attention: the context is cut
            # to it, so every token the engine computes is the model's.
            log.warning(
                "sliding_window %d < max_position_embeddings %d: a target's context is cut "
                "to %d tokens (specserve does not run sliding-window attention; a draft "
                "model drafts past them with full attention, each draft verified)",
                window,
                context,
                window,
            )
            context = window
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=context,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            rope_scaling=scaling,
            sliding_window=window,
            dtype=_DTYPE_NAMES.get(str(dtype_name).replace("torch.", ""), torch.float32),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_ids(raw.get("eos_token_id")),
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the required key {e.args[0]!r}") from None


def _json_object(path: Path) -> dict:
    """A JSON object from a file, or CheckpointError saying what is wrong with it."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object; got {type(raw).__name__}")
    return raw


def load_hf_config(folder: str | Path) -> ModelConfig:
    """Read and normalize `folder/config.json`."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; a Hugging Face model folder needs one")
    raw = _json_object(path)
    gen = Path(folder) / "generation_config.json"
    if gen.is_file():
        # generation_config.json often lists more stop ids (e.g. Llama-3 <|eot_id|>).
        eos = _json_object(gen).get("eos_token_id")
        if eos is not None:
            raw = {**raw, "eos_token_id": sorted(set(_ids(raw.get("eos_token_id")) + _ids(eos)))}
    return config_from_dict(raw)
