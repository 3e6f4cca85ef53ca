"""The merged q/k/v and gate/up parameters load strictly from checkpoints that keep them
apart (errors name the checkpoint's tensors), and the fused residual path returns the
residual stream entering each requested layer exactly as transformers does."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import CheckpointError
from specserve.core.kv_cache import KVCache
from specserve.layers.attention import TorchAttentionBackend
from specserve.model.checkpoint import checkpoint_layout
from specserve.model.llama import LlamaForCausalLM
from specserve.model.loader import load_model, resolve_model
from tests.support.model_cases import build_meta, tiny_config


def _edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return dst


def _load(folder: Path) -> LlamaForCausalLM:
    return load_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"))


def test_layout_maps_checkpoint_names_to_merged_rows():
    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_config(qkv_bias=True))
    layout = checkpoint_layout(model)
    prefix = "model.layers.1."
    assert layout[prefix + "self_attn.q_proj.weight"] == (
        prefix + "self_attn.qkv_proj.weight",
        0,
        (64, 64),
    )
    assert layout[prefix + "self_attn.k_proj.weight"][1:] == (64, (32, 64))
    assert layout[prefix + "self_attn.v_proj.bias"] == (
        prefix + "self_attn.qkv_proj.bias",
        96,
        (32,),
    )
    assert layout[prefix + "mlp.up_proj.weight"] == (
        prefix + "mlp.gate_up_proj.weight",
        96,
        (96, 64),
    )
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in layout)


def test_merged_weights_equal_the_checkpoint_tensors(tiny_qwen2):
    model = _load(tiny_qwen2)
    tensors = load_file(str(tiny_qwen2 / "model.safetensors"))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    want = torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.bias, want)
    want = torch.cat([tensors[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(mlp.gate_up_proj.weight, want)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"),
            r"lacks 1 tensor.*'?model\.layers\.0\.self_attn\.k_proj\.weight",
        ),
        (
            lambda t: t.update({"model.layers.1.self_attn.v_proj.weight": torch.zeros(8, 64)}),
            r"'model\.layers\.1\.self_attn\.v_proj\.weight' has shape \(8, 64\)",
        ),
        (
            lambda t: t.update(
                {
                    "model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"].to(
                        torch.int32
                    )
                }
            ),
            r"'model\.layers\.0\.mlp\.up_proj\.weight' has dtype torch\.int32",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(2, 2)}),
            r"unexpected tensor 'model\.layers\.0\.self_attn\.qkv_proj\.weight'",
        ),
    ],
)
def test_strict_loading_names_the_checkpoint_tensor(tiny_llama, tmp_path, edit, match):
    folder = _edited(tiny_llama, tmp_path / "m", edit)
    with pytest.raises(CheckpointError, match=match):
        _load(folder)


def test_qkv_bias_is_required_when_the_config_has_it(tiny_qwen2, tmp_path):
    folder = _edited(
        tiny_qwen2, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.q_proj.bias")
    )
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor.*q_proj\.bias"):
        _load(folder)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_aux_states_and_final_hidden_match_transformers(family, request):
    import transformers

    folder = request.getfixturevalue(f"tiny_{family}")
    model = _load(folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([5, 17, 33, 80, 120, 7, 9, 200, 11])
    cfg = model.config
    kv = KVCache(cfg, 8, 4, torch.float32, torch.device("cpu"))
    table = kv.allocator.allocate(3)
    meta = build_meta([table], [0], [len(ids)], 4, "cpu")
    with torch.inference_mode():
        hidden, aux = model(ids, meta, kv.layers, TorchAttentionBackend(), (0, 1))
    with torch.no_grad():
        out = ref(ids[None], output_hidden_states=True)
    assert len(aux) == 2
    for j, a in enumerate(aux):  # hidden_states[j] is the residual stream entering layer j
        torch.testing.assert_close(a, out.hidden_states[j][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, out.hidden_states[-1][0], atol=1e-5, rtol=1e-5)
