"""GGUF (llama.cpp) checkpoints: config from metadata, tensors dequantized with `gguf`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from specserve.core.errors import CheckpointError, UnsupportedModelError
from specserve.core.model_config import ModelConfig, config_from_dict

_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


@lru_cache(maxsize=4)
def _reader(path: Path):
    import gguf

    return gguf.GGUFReader(str(path))


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(path: Path) -> ModelConfig:
    """Translate GGUF metadata into the keys of a Hugging Face config."""
    r = _reader(path)
    arch = _field(r, "general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHS)})"
        )
    names = {t.name for t in r.tensors}
    heads = _field(r, f"{arch}.attention.head_count")
    hidden = _field(r, f"{arch}.embedding_length")
    vocab = _field(r, f"{arch}.vocab_size") or len(_field(r, "tokenizer.ggml.tokens"))
    raw = {
        "architectures": [_ARCHS[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _field(r, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(r, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(r, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(r, f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": _field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _field(r, f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": _field(r, f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
        "dtype": "float32",
    }
    return config_from_dict(raw)


def _hf_name(gguf_name: str) -> str:
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part not in _LAYER_NAMES:
            raise CheckpointError(f"GGUF tensor {gguf_name!r} has no counterpart in the model")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base not in _GLOBAL_NAMES:
        raise CheckpointError(f"GGUF tensor {gguf_name!r} has no counterpart in the model")
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of attn_q / attn_k (interleaved -> rotate-half)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(path: Path, cfg: ModelConfig) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
    """Yield (Hugging Face name, fp32 tensor) for every tensor of the file."""
    from gguf.quants import dequantize

    r = _reader(path)
    arch = _field(r, "general.architecture")

    def iterate():
        for t in r.tensors:
            array = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            array = array.reshape(tuple(int(d) for d in reversed(t.shape)))
            if arch == "llama" and t.name.endswith("attn_q.weight"):
                array = _unpermute(array, cfg.num_heads)
            elif arch == "llama" and t.name.endswith("attn_k.weight"):
                array = _unpermute(array, cfg.num_kv_heads)
            yield _hf_name(t.name), torch.from_numpy(np.array(array, copy=True))

    return iterate(), len(r.tensors)
