"""GGUF (llama.cpp) checkpoints: config from metadata, tensors dequantized with `gguf`, a
tensor-parallel rank dequantizing only its part of each (the file is memory-mapped)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from specserve.core.errors import CheckpointError, UnsupportedModelError
from specserve.core.model_config import ModelConfig, RopeFreqFactors, config_from_dict
from specserve.core.parallel import TensorSlice

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
_ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's Llama 3.1 scaling: read into the config


@lru_cache(maxsize=4)
def _reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:  # (empty, truncated, or not GGUF: its magic)
        raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from None


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
    cfg = config_from_dict(raw)
    scaling = _field(r, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModelError(
            f"GGUF rope scaling {scaling!r} ({arch}.rope.scaling.type) is not supported "
            "(supported: none, and llama3's per-frequency factors in rope_freqs.weight)"
        )
    rotary = _field(r, f"{arch}.rope.dimension_count", cfg.head_dim)
    if rotary != cfg.head_dim:
        raise UnsupportedModelError(
            f"GGUF {arch}.rope.dimension_count {rotary} rotates part of a head of "
            f"{cfg.head_dim}: partial rotary embedding is not supported"
        )
    freqs = next((t for t in r.tensors if t.name == _ROPE_FREQS), None)
    if freqs is not None:
        factors = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        if factors.shape[0] != cfg.head_dim // 2:
            raise CheckpointError(
                f"GGUF tensor {_ROPE_FREQS!r} has {factors.shape[0]} factors; a head of "
                f"{cfg.head_dim} has {cfg.head_dim // 2} rotary frequencies"
            )
        cfg = replace(cfg, rope_scaling=RopeFreqFactors(tuple(float(f) for f in factors)))
    return cfg


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


class GgufTensor:
    """A tensor of a GGUF file, dequantized when read, and only the part asked for.

    Rows (a column-parallel or vocabulary shard) are sliced from the memory-mapped data
    before dequantizing: quantization blocks run along a row. Columns (a row-parallel
    shard) are sliced in the quantized bytes when both ends fall on a block boundary (every
    row's blocks from the first to the last), else the rows are dequantized whole and then
    sliced. llama.cpp permutes the rows of attn_q / attn_k within each head: a shard holds
    whole heads, so it is un-permuted after slicing, head by head as the whole tensor is.
    """

    def __init__(self, tensor, permuted_heads: int | None = None):
        self.tensor = tensor
        self.permuted_heads = permuted_heads  # the whole tensor's heads, or None
        self.shape = tuple(int(d) for d in reversed(tensor.shape))

    def read(self, part: TensorSlice | None) -> torch.Tensor:
        array = self._dequantized(part)
        if self.permuted_heads is not None:
            array = _unpermute(array, self.permuted_heads * array.shape[0] // self.shape[0])
        return torch.from_numpy(np.array(array, dtype=np.float32, copy=True))

    def _dequantized(self, part: TensorSlice | None) -> np.ndarray:
        from gguf.constants import GGML_QUANT_SIZES
        from gguf.quants import dequantize

        data, kind, shape = self.tensor.data, self.tensor.tensor_type, self.shape
        # quantized data is [rows, bytes of a row]; plain float data [rows, columns]
        in_bytes = data.dtype == np.uint8
        if part is None or (part.dim == 0 and len(shape) == 1 and in_bytes):
            array = dequantize(data, kind).reshape(shape)
            return array if part is None else part_of(array, part)
        end = part.start + part.length
        if part.dim == 0:
            return dequantize(data[part.start : end], kind).reshape(part.length, *shape[1:])
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if not in_bytes:
            return dequantize(data[:, part.start : end], kind)
        if part.start % block == 0 and end % block == 0:
            cols = slice(part.start // block * block_bytes, end // block * block_bytes)
            return dequantize(data[:, cols], kind).reshape(shape[0], part.length)
        return part_of(dequantize(data, kind).reshape(shape), part)


def part_of(array: np.ndarray, part: TensorSlice) -> np.ndarray:
    index = [slice(None)] * array.ndim
    index[part.dim] = slice(part.start, part.start + part.length)
    return array[tuple(index)]


def gguf_tensors(path: Path, cfg: ModelConfig) -> tuple[Iterator[tuple[str, GgufTensor]], int]:
    """(Hugging Face name, tensor not read yet) for every tensor of the file, and how many
    there are; read, a tensor is fp32."""
    r = _reader(path)
    arch = _field(r, "general.architecture")

    tensors = [t for t in r.tensors if t.name != _ROPE_FREQS]

    def iterate():
        for t in tensors:
            heads = None
            if arch == "llama" and t.name.endswith("attn_q.weight"):
                heads = cfg.num_heads
            elif arch == "llama" and t.name.endswith("attn_k.weight"):
                heads = cfg.num_kv_heads
            yield _hf_name(t.name), GgufTensor(t, heads)

    return iterate(), len(tensors)
