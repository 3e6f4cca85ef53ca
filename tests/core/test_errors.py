"""User-facing failures raise one clear error type whose message says what to fix; configs
of transformers 4.x and 5.x mean the same; half-precision and sharded checkpoints load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import (
    LLM,
    CheckpointError,
    InvalidRequestError,
    RequestTooLargeError,
    SamplingParams,
    UnsupportedModelError,
)
from specserve.core.model_config import config_from_dict, load_hf_config
from specserve.model.loader import resolve_model
from tests.support.tiny_models import hf_greedy, make_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 80, 120], [200, 7, 9], list(range(40, 70))]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


# ---- checkpoints -------------------------------------------------------------------------


def test_unknown_architecture(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "m")
    edit_config(folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(str(folder))


def test_unknown_gguf_architecture(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported.*llama"):
        LLM(str(path))


def test_unsupported_rope_scaling():
    raw = dict(LLAMA_4X, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="'yarn'.*llama3"):
        config_from_dict(raw)


def test_path_that_is_no_model(tmp_path):
    with pytest.raises(CheckpointError, match="^model '.*nowhere' is neither a Hugging Face"):
        LLM(str(tmp_path / "nowhere"))
    # the draft model's path is named as its own option, not as the model's
    with pytest.raises(CheckpointError, match="^speculative_draft_model_path '.*nowhere' is"):
        resolve_model(str(tmp_path / "nowhere"), option="speculative_draft_model_path")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(str(tmp_path / "empty"))


def test_sharded_index_naming_a_missing_shard(tiny_sharded, tmp_path):
    folder = copy_model(tiny_sharded, tmp_path / "m")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name} listed in the index is missing"):
        LLM(str(folder))


def test_folder_without_safetensors(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors.*convert"):
        LLM(str(folder))


def rewrite_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_tensor(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "m")
    rewrite_weights(folder, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(CheckpointError, match="lacks 1 tensor.*layers.1.mlp.down_proj.weight"):
        LLM(str(folder))


def test_extra_tensor(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "m")
    rewrite_weights(folder, lambda t: t.update({"model.layers.0.adapter.weight": torch.ones(2)}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.adapter.weight'"):
        LLM(str(folder))


def test_shape_mismatch(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "m")
    edit_config(folder, intermediate_size=96)
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.\d\.mlp\.\w+\.weight' has shape "
        r"\(.*128.*\), the config implies \(.*96.*\)",
    ):
        LLM(str(folder))


def test_config_lacking_a_required_key(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "m")
    edit_config(folder, hidden_size=None)
    with pytest.raises(CheckpointError, match="'hidden_size'"):
        LLM(str(folder))


# ---- requests ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=32)


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(llm, prompt):
    with pytest.raises(InvalidRequestError, match="prompt is empty") as err:
        llm.engine.add_request(prompt, GREEDY)
    assert err.value.field == "prompt"


def test_prompt_token_outside_the_vocabulary(llm):
    with pytest.raises(InvalidRequestError, match=r"\[0, 384\)") as err:
        llm.engine.add_request([1, 2, 384], GREEDY)
    assert err.value.field == "prompt"


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.5),
        ("temperature", -0.1),
        ("temperature", 1000.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("seed", "x"),
        ("stop", [""]),
        ("logprobs", 99),
        # (kept as given, failing at generate, or bare TypeErrors)
        ("ignore_eos", "no"),
        ("grammar", "json"),
        ("stop", 5),
        ("stop_token_ids", 5),
        ("stop_token_ids", "12"),
        ("logit_bias", [1, 2]),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=f"^{field} .*got") as err:
        SamplingParams(**{field: value})
    assert err.value.field == field
    assert isinstance(err.value, ValueError)  # also a ValueError for generic handlers


def test_prompt_longer_than_the_context(llm):
    with pytest.raises(RequestTooLargeError, match="40 tokens.*context is 32") as err:
        llm.engine.add_request(list(range(3, 43)), GREEDY)
    assert err.value.field == "prompt"
    with pytest.raises(RequestTooLargeError):
        llm.engine.add_request(list(range(3, 35)), GREEDY)  # exactly the context: no room
    assert not llm.engine.has_unfinished() and not llm.engine.requests


def test_a_bad_prompt_in_a_batch_leaves_nothing_queued(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6, 7], []], GREEDY)
    assert not llm.engine.has_unfinished() and llm.engine.kv.allocator.num_used == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 32 - 3  # capped by context


# ---- config keys of transformers 4.x and 5.x ---------------------------------------------

_COMMON = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=[2, 3],
)
_LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
LLAMA_4X = dict(
    _COMMON,
    rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", **_LLAMA3},
    torch_dtype="bfloat16",
)
LLAMA_5X = dict(
    _COMMON,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **_LLAMA3},
    dtype="bfloat16",
)


def test_4x_and_5x_config_keys_mean_the_same():
    old, new = config_from_dict(LLAMA_4X), config_from_dict(LLAMA_5X)
    assert old == new
    assert new.rope_theta == 500000.0 and new.rope_scaling.factor == 8.0
    assert new.dtype == torch.bfloat16 and new.eos_token_ids == (2, 3)
    older = dict(LLAMA_4X, rope_scaling={"type": "llama3", **_LLAMA3})  # pre-4.45 spelling
    assert config_from_dict(older) == new
    plain_4x = dict(_COMMON, rope_theta=1e6, torch_dtype="float16")
    plain_5x = dict(
        _COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, dtype="float16"
    )
    assert config_from_dict(plain_4x) == config_from_dict(plain_5x)
    assert config_from_dict(plain_5x).rope_scaling is None


def test_4x_config_folder_generates_like_5x(tiny_llama, tmp_path):
    """The tiny Llama (saved by transformers 5 with rope_parameters) rewritten with 4.x keys
    loads to the same config and generates the same tokens."""
    folder = copy_model(tiny_llama, tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    rope = dict(raw.pop("rope_parameters"))
    edit_config(
        folder,
        rope_parameters=None,
        dtype=None,
        rope_theta=rope.pop("rope_theta"),
        rope_scaling=rope,
        torch_dtype=raw["dtype"],
    )
    assert "rope_parameters" not in json.loads((folder / "config.json").read_text())
    assert load_hf_config(folder) == load_hf_config(tiny_llama)
    new = LLM(str(tiny_llama)).generate(PROMPTS, GREEDY)
    old = LLM(str(folder)).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in old] == [o.token_ids for o in new]


# ---- half-precision and sharded checkpoints ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_sharded(tiny_llama, tmp_path_factory):
    """tiny_llama re-saved by transformers in 60 KB shards, with its tokenizer."""
    import transformers

    folder = tmp_path_factory.mktemp("sharded")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.save_pretrained(folder, max_shard_size="60KB")
    for f in tiny_llama.glob("tokenizer*"):
        shutil.copy(f, folder / f.name)
    return folder


def test_sharded_checkpoint_loads_and_matches(tiny_sharded, tiny_llama):
    assert (tiny_sharded / "model.safetensors.index.json").is_file()
    assert len(list(tiny_sharded.glob("model-*.safetensors"))) > 3
    sharded = LLM(str(tiny_sharded)).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in sharded] == hf_greedy(tiny_llama, PROMPTS, GREEDY.max_tokens)


def hf_logprobs(folder: Path, ids: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoint_loads_in_fp32_on_cpu(tmp_path, dtype):
    folder = make_tiny_model(tmp_path / "m", "qwen3", dtype=dtype, seed=3)
    assert load_hf_config(folder).dtype == dtype
    llm = LLM(str(folder))
    assert llm.engine.dtype == torch.float32
    weights = {p.dtype for p in llm.engine.runner.model.parameters()}
    assert weights == {torch.float32}
    prompt = PROMPTS[2]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=20)
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == hf_greedy(folder, [prompt], 6)[0]
    # The same half weights upcast by transformers: log-probabilities agree to fp32 noise.
    ref = hf_logprobs(folder, prompt + out.token_ids)
    lps = _logprobs_of(llm, prompt, params)
    assert len(lps) == len(out.token_ids)
    for i, lp in enumerate(lps):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp.logprob - row[out.token_ids[i]].item()) < 1e-4
        for tok, value in lp.top:
            assert abs(value - row[tok].item()) < 1e-4
        top_values = torch.tensor([value for _, value in lp.top])
        assert torch.allclose(top_values, row.topk(20).values, atol=1e-4)


def _logprobs_of(llm, prompt, params):
    rid = llm.engine.add_request(prompt, params)
    lps = []
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if out.request_id == rid:
                lps += out.new_logprobs
    return lps
