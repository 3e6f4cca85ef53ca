"""Config fields a Llama-family checkpoint may carry: each is either served as transformers
(or llama.cpp) computes it or refused naming the field, never run silently wrong. Sliding
windows cut the context to the window (where full attention is exact), GGUF files carry
Llama 3.1's scaling as per-frequency factors (`rope_freqs.weight`)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.core.errors import CheckpointError, RequestTooLargeError, UnsupportedModelError
from specserve.core.kv_cache import KVCache
from specserve.core.model_config import RopeFreqFactors, config_from_dict
from specserve.layers.attention import TorchAttentionBackend
from specserve.model.loader import ModelSource, load_model
from tests.support.model_cases import build_meta
from tests.support.tiny_models import VOCAB, hf_greedy, make_tokenizer

BASE = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def _config(arch: str, **fields):
    return config_from_dict({"architectures": [arch], **BASE, **fields})


@pytest.mark.parametrize(
    "arch, fields, window, context",
    [
        ("MistralForCausalLM", {"sliding_window": 8}, 8, 8),
        ("MistralForCausalLM", {}, 4096, 512),  # transformers' default window, above 512
        ("MistralForCausalLM", {"sliding_window": None}, None, 512),
        ("Qwen2ForCausalLM", {"sliding_window": 8}, None, 512),  # use_sliding_window off
        (
            "Qwen2ForCausalLM",  # layers from max_window_layers on are windowed
            {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1},
            8,
            8,
        ),
        (
            "Qwen2ForCausalLM",  # the windowed layers start past the last one (28 of 2)
            {"sliding_window": 8, "use_sliding_window": True},
            None,
            512,
        ),
        (
            "Qwen3ForCausalLM",
            {"sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"]},
            8,
            8,
        ),
        ("LlamaForCausalLM", {"sliding_window": 8}, None, 512),  # Llama has no window
    ],
)
def test_a_sliding_window_cuts_the_context_to_it(arch, fields, window, context):
    cfg = _config(arch, **fields)
    assert (cfg.sliding_window, cfg.max_position_embeddings) == (window, context)


def test_a_windowed_model_is_served_exactly_within_its_window(tmp_path):
    """Mistral with an 8-token window: up to 8 tokens the engine's tokens are transformers'
    (which windows), and no request goes past them."""
    import transformers

    cfg = transformers.MistralConfig(
        **{**BASE, "vocab_size": VOCAB, "max_position_embeddings": 512},
        sliding_window=8,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.MistralForCausalLM(cfg).save_pretrained(tmp_path)
    make_tokenizer(tmp_path)
    prompt = [5, 17, 33, 80, 120]
    llm = LLM(str(tmp_path), page_size=4)
    out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 3
    assert out[0].token_ids == hf_greedy(tmp_path, [prompt], 3)[0]
    with pytest.raises(RequestTooLargeError):
        llm.generate([list(range(3, 11))], SamplingParams(max_tokens=1))


@pytest.mark.parametrize(
    "arch, fields, words",
    [
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
        ("Qwen2ForCausalLM", {"hidden_act": "relu"}, "hidden_act"),
        ("LlamaForCausalLM", {"mlp_bias": True}, "mlp_bias"),
        ("LlamaForCausalLM", {"attention_bias": True}, "attention_bias"),
        ("Qwen3ForCausalLM", {"attention_bias": True}, "attention_bias"),
    ],
)
def test_fields_that_would_run_wrongly_are_refused_by_name(arch, fields, words):
    with pytest.raises(UnsupportedModelError, match=words):
        _config(arch, **fields)


def test_fields_transformers_ignores_are_ignored():
    # Mistral's and Qwen2's attention take no attention_bias (Qwen2's q/k/v always have one)
    assert not _config("MistralForCausalLM", attention_bias=True).qkv_bias
    assert _config("Qwen2ForCausalLM", attention_bias=False).qkv_bias
    assert _config("LlamaForCausalLM", hidden_act="swish").hidden_size == 64


# ---- GGUF: rope scaling ----------------------------------------------------------------------


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of attn_q / attn_k (rotate-half -> interleaved pairs)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _llama3_factors(raw: dict, head_dim: int) -> np.ndarray:
    """The factors llama.cpp's converter writes for a llama3-scaled model (one a frequency:
    1 for short wavelengths, `factor` for long ones, a smooth step between)."""
    rope = raw.get("rope_parameters") or raw["rope_scaling"]
    theta = rope.get("rope_theta", raw.get("rope_theta"))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _to_gguf(folder, path, extra_meta=(), rope_freqs=None):
    """The tiny Llama folder as llama.cpp would write it (F32), with `extra_meta` keys and a
    rope_freqs tensor."""
    import gguf
    from safetensors.torch import load_file

    raw = json.loads((folder / "config.json").read_text())
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "vocab_size": raw["vocab_size"],
        "embedding_length": raw["hidden_size"],
        "feed_forward_length": raw["intermediate_size"],
        "block_count": raw["num_hidden_layers"],
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "context_length": raw["max_position_embeddings"],
    }.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", raw["rms_norm_eps"])
    rope = raw.get("rope_parameters") or {}
    w.add_float32("llama.rope.freq_base", rope.get("rope_theta", raw.get("rope_theta")))
    for key, value in extra_meta:
        w.add_string(key, value)
    for name, t in load_file(folder / "model.safetensors").items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", a)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", a)
        elif name == "lm_head.weight":
            w.add_tensor("output.weight", a)
        else:
            parts = name.split(".")
            layer, module = parts[2], ".".join(parts[3:-1])
            if module == "self_attn.q_proj":
                a = _permute(a, heads)
            elif module == "self_attn.k_proj":
                a = _permute(a, kv_heads)
            w.add_tensor(f"blk.{layer}.{_NAMES[module]}.{parts[-1]}", a)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(source: ModelSource, prompt: list[int]) -> torch.Tensor:
    model = load_model(source, torch.float32, torch.device("cpu"))
    pages = -(-len(prompt) // 16)
    kv = KVCache(model.kv_config, 1 + pages, 16, torch.float32, "cpu")
    meta = build_meta([kv.allocator.allocate(pages)], [0], [len(prompt)], 16, "cpu")
    with torch.inference_mode():
        hidden, _ = model(torch.tensor(prompt), meta, kv.layers, TorchAttentionBackend())
        return model.compute_logits(hidden)


def test_a_gguf_llama3_model_uses_its_rope_freqs(tiny_llama, tmp_path):
    """tiny_llama is llama3-scaled (factor 8 over 64 original positions): its GGUF, with
    the factors llama.cpp writes, computes transformers' logits over 300 positions; without
    them it would not (the scaling is visible)."""
    import transformers

    raw = json.loads((tiny_llama / "config.json").read_text())
    factors = _llama3_factors(raw, raw["hidden_size"] // raw["num_attention_heads"])
    assert len(set(factors.tolist())) > 2  # short, long and smoothed frequencies
    prompt = [(7 * i + 3) % VOCAB for i in range(300)]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0]
    path = _to_gguf(tiny_llama, tmp_path / "scaled.gguf", rope_freqs=factors)
    got = _logits(ModelSource(path, "gguf"), prompt)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    plain = _to_gguf(tiny_llama, tmp_path / "unscaled.gguf")
    assert (_logits(ModelSource(plain, "gguf"), prompt) - want).abs().max() > 1e-2


def test_gguf_rope_fields_it_cannot_serve_are_refused(tiny_llama, tmp_path):
    from specserve.model.gguf_file import gguf_config

    linear = _to_gguf(tiny_llama, tmp_path / "l.gguf", [("llama.rope.scaling.type", "linear")])
    with pytest.raises(UnsupportedModelError, match="rope.scaling.type"):
        gguf_config(linear)
    short = _to_gguf(tiny_llama, tmp_path / "f.gguf", rope_freqs=np.ones(3, np.float32))
    with pytest.raises(CheckpointError, match="rope_freqs"):
        gguf_config(short)
    cfg = gguf_config(
        _to_gguf(tiny_llama, tmp_path / "n.gguf", [("llama.rope.scaling.type", "none")])
    )
    assert cfg.rope_scaling is None and not isinstance(cfg.rope_scaling, RopeFreqFactors)
