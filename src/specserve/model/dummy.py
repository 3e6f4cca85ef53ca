"""`--load-format dummy`: models of a real shape with random weights, built on the device in
seconds (as vLLM names it), so benchmarks of large shapes need no multi-GB checkpoint.

The shape comes from a preset name (`PRESETS`), a config.json file, or a folder holding one;
without a model, the embedded default model's shape. The tokenizer is the folder's when it
has one, else a synthetic one: every token is its id written in decimal and tokens are
separated by spaces ("17 4096 5"), so any vocabulary size round-trips exactly, prompts can be
built token by token, and every id decodes. Its chat template joins the messages' contents.
Outputs of random weights are noise: use with `--speculative-simulate-acceptance` to
benchmark speculation.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from specserve.core.errors import CheckpointError
from specserve.core.model_config import ModelConfig, config_from_dict
from specserve.core.parallel import SINGLE_RANK, TensorParallel

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": _LLAMA3_ROPE,
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "dtype": "bfloat16",
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}
# Hugging Face config.json contents of the shapes benchmarks use.
PRESETS: dict[str, dict] = {
    "llama-3.1-8b": {
        **_LLAMA31,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    },
    "llama-3.1-70b": {
        **_LLAMA31,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    },
}
DEFAULT_PRESET = "smollm2-135m"  # the embedded default model's shape
_WEIGHT_STD = 0.02  # random weights as models are initialized for training
_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def dummy_config(ref: str | None) -> ModelConfig:
    """The shape `ref` names: a preset, a config.json, or a folder with one (None: the
    default model's shape)."""
    return config_from_dict(_raw_config(ref))


def check_dummy_ref(ref: str | None) -> None:
    """Fail with a CheckpointError naming the choices when `ref` names no shape."""
    _raw_config(ref)


def _raw_config(ref: str | None) -> dict:
    ref = ref or DEFAULT_PRESET
    if ref in PRESETS:
        return dict(PRESETS[ref])
    path = Path(ref)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file() and path.suffix == ".json":
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    raise CheckpointError(
        f"--load-format dummy needs a shape: {ref!r} is neither a preset "
        f"({', '.join(PRESETS)}) nor a config.json or a folder holding one"
    )


def tokenizer_folder(ref: str | None) -> Path | None:
    """The folder whose tokenizer a dummy model of `ref` uses, or None (synthetic)."""
    if ref is None or ref in PRESETS:
        return None
    path = Path(ref)
    folder = path if path.is_dir() else path.parent
    if any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return folder
    return None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Modules built inside get `dtype` parameters directly."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _init_(module: torch.nn.Module, seed: int) -> None:
    """Norm weights 1, every other parameter N(0, 0.02), from a seeded generator."""
    params = list(module.named_parameters())
    if not params:
        return
    gen = torch.Generator(device=params[0][1].device).manual_seed(seed)
    with torch.no_grad():
        for name, p in params:
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, _WEIGHT_STD, generator=gen)


def build_dummy_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    tp: TensorParallel = SINGLE_RANK,
):
    """A LlamaForCausalLM of `cfg` with random weights, built in place on `device`. A
    tensor-parallel rank holds its shard of the unsharded model's weights of the same seed
    (so benchmarks at any size run the same model): each parameter is drawn whole on the
    device, as the unsharded model draws it, one at a time, and the rank keeps its part."""
    from specserve.model.llama import LlamaForCausalLM

    if tp.size > 1:
        return _sharded_dummy_model(cfg, dtype, torch.device(device), seed, tp)
    with torch.device(device), _default_dtype(dtype):  # (no float32 copy first: 8B is 32 GB)
        model = LlamaForCausalLM(cfg)
    _init_(model, seed)
    model.rotary.materialize(torch.device(device))
    return model.eval()


def _sharded_dummy_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int, tp: TensorParallel
):
    from specserve.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, tp)
    _init_shard_(model, dtype, device, seed)
    model.rotary.materialize(device)
    return model.eval()


def _init_shard_(module: torch.nn.Module, dtype: torch.dtype, device: torch.device, seed: int):
    """Fill a meta-built rank's shard with its part of the weights `_init_` gives the
    unsharded module of the same seed: each parameter drawn whole on the device, one at a
    time, in the same order, and cut to the rank's part."""
    from specserve.model.checkpoint import assign_weights, full_tensors

    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(name: str, shape: tuple[int, ...]) -> torch.Tensor:  # as `_init_` draws it
        full = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            return full.fill_(1.0)
        return full.normal_(0.0, _WEIGHT_STD, generator=gen)

    with torch.no_grad():
        assign_weights(module, full_tensors(module, draw), dtype, device)


def dummy_eagle3_config(target: ModelConfig, draft_vocab_size: int = 32000):
    """The shape of a random EAGLE-3 head for `target`: one decoder layer of its shape, the
    draft vocabulary its first `draft_vocab_size` ids (public Llama-3.1 heads use 32000)."""
    from specserve.model.eagle3 import Eagle3Config

    return Eagle3Config.for_target(target, min(draft_vocab_size, target.vocab_size))


def build_dummy_eagle3_head(
    target: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    tp: TensorParallel = SINGLE_RANK,
):
    """An EAGLE-3 head of `dummy_eagle3_config(target)` with random weights (with `tp`,
    that rank's shard of the same weights)."""
    from specserve.model.eagle3 import Eagle3Head

    cfg = dummy_eagle3_config(target)
    if tp.size > 1:
        with torch.device("meta"):
            head = Eagle3Head(cfg, cfg.aux_layer_ids(target.num_layers), tp)
        _init_shard_(head, dtype, torch.device(device), seed + 1)
    else:
        with torch.device(device), _default_dtype(dtype):
            head = Eagle3Head(cfg, cfg.aux_layer_ids(target.num_layers))
        _init_(head, seed + 1)
    draft_vocab = cfg.draft_vocab_size
    head.d2t = torch.zeros(draft_vocab, dtype=torch.int64, device=device)  # draft id i: id i
    head.t2d = torch.zeros(target.vocab_size, dtype=torch.bool, device=device)
    head.t2d[:draft_vocab] = True
    head.rotary.materialize(torch.device(device))
    return head.eval()


def synthetic_tokenizer(cfg: ModelConfig):
    """A transformers fast tokenizer over cfg.vocab_size tokens, each its id in decimal,
    split and joined by spaces (see the module)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(cfg.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()

    def word(token_id: int) -> AddedToken:  # whole words only: "1" must not split "110"
        return AddedToken(str(token_id), single_word=True, special=True)

    special = {"unk_token": word(0)}
    if cfg.bos_token_id is not None and cfg.bos_token_id < cfg.vocab_size:
        special["bos_token"] = word(cfg.bos_token_id)
    if cfg.eos_token_ids and cfg.eos_token_ids[0] < cfg.vocab_size:
        special["eos_token"] = word(cfg.eos_token_ids[0])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer
