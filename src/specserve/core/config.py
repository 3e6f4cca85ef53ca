"""Engine configuration: EngineConfig composed of its sections (core/config_sections.py), the
checks that span sections, and the table mapping the flat option names users type (the CLI's
flags, LLM's keywords) onto section fields; the CLI takes its defaults from here."""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from specserve.core.config_sections import (
    CacheConfig,
    ExecutionConfig,
    ModelLoadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from specserve.core.errors import ConfigError

# flat option name -> (section, field): the one place the flat names live. In the order the
# CLI lists the flags (each help group shows its flags in this order).
FLAG_FIELDS: dict[str, tuple[str, str]] = {
    "model": ("load", "model"),
    "load_format": ("load", "format"),
    "dtype": ("load", "dtype"),
    "device": ("load", "device"),
    "page_size": ("cache", "page_size"),
    "kv_cache_bytes": ("cache", "size_bytes"),
    "kv_cache_memory_fraction": ("cache", "memory_fraction"),
    "num_kv_pages": ("cache", "num_pages"),
    "disable_prefix_caching": ("cache", "disable_prefix_caching"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "max_model_len": ("scheduler", "max_model_len"),
    "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
    "nnodes": ("parallel", "nnodes"),
    "node_rank": ("parallel", "node_rank"),
    "dist_init_addr": ("parallel", "dist_init_addr"),
    "seed": ("load", "seed"),
    "speculative_algorithm": ("speculative", "algorithm"),
    "speculative_draft_model_path": ("speculative", "draft_model_path"),
    "speculative_num_steps": ("speculative", "num_steps"),
    "speculative_policy": ("speculative", "policy"),
    "speculative_schedule": ("speculative", "schedule"),
    "speculative_simulate_acceptance": ("speculative", "simulate_acceptance"),
    "speculative_head_parallel": ("speculative", "head_parallel"),
    "speculative_trace_file": ("speculative", "trace_file"),
    "attention_backend": ("execution", "attention_backend"),
    "disable_cuda_graph": ("execution", "disable_cuda_graph"),
    "disable_gemv": ("execution", "disable_gemv"),
    "disable_gemv_tuning": ("execution", "disable_gemv_tuning"),
    "disable_batch_invariance": ("execution", "disable_batch_invariance"),
    "disable_verify_tiles": ("execution", "disable_verify_tiles"),
    "disable_pdl": ("execution", "disable_pdl"),
    "gemv_stream_k": ("execution", "gemv_stream_k"),
    "disable_fusion": ("execution", "disable_fusion"),
    "overlap_schedule": ("execution", "overlap_schedule"),
    "disable_overlap_schedule": ("execution", "disable_overlap_schedule"),
    "cuda_graph_max_batch": ("execution", "cuda_graph_max_batch"),
    "cuda_graph_max_tokens": ("execution", "cuda_graph_max_tokens"),
    "grammar_workers": ("execution", "grammar_workers"),
    "debug_tp_check": ("parallel", "debug_check"),
}


@dataclass
class EngineConfig:
    """What to load and how much of the machine to use, in sections: `load` (model, format,
    dtype, device, seed), `cache` (the KV cache's size), `scheduler` (requests and tokens
    per step, context), `parallel` (tensor parallelism), `speculative` (drafting) and
    `execution` (kernels, CUDA graphs, the step loop). Each section checks its own fields;
    checks across sections run here.

    Users name options flat (`--speculative-num-steps`, `LLM(page_size=...)`): `from_flags`
    builds a config from those names and `flags` gives them back (FLAG_FIELDS maps them).
    With `load.format` "dummy" an EAGLE-3 drafter without a path is a random head of the
    target's shape, and a draft model's path names a shape (model/dummy.py).
    """

    load: ModelLoadConfig = field(default_factory=ModelLoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)

    def __post_init__(self) -> None:
        if self.speculative.algorithm == "auto":  # a new section: the given one is left as is
            self.speculative = replace(self.speculative, **self._auto_speculation())
            # (a drafter's options where the model left no drafter did nothing; with
            # speculative_algorithm none given, they are switched off on purpose: a sweep's
            # "off" server is its common flags, a drafter's included, and that one)
            self.speculative.check_drafter()
        spec = self.speculative
        if spec.algorithm == "ngram" and spec.draft_model_path is not None:
            raise ConfigError("speculative_draft_model_path is read by eagle3 and draft, not ngram")
        if spec.algorithm in ("draft", "ngram") and spec.head_parallel != "replicated":
            raise ConfigError(
                f"speculative_head_parallel is read by eagle3 only, not {spec.algorithm}"
            )
        if (
            spec.algorithm == "eagle3"
            and spec.draft_model_path is None
            and self.load.model is None
            and self.load.format != "dummy"
            and (shipped_head_path() / "config.json").is_file()
        ):  # the embedded model's head, as with the algorithm left to auto
            self.speculative = spec = replace(spec, draft_model_path=str(shipped_head_path()))
        if (
            self.execution.attention_backend == "triton"
            and self.load.torch_device().type != "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1"  # (the interpreter runs on the CPU)
        ):
            raise ConfigError("attention_backend triton needs a CUDA device; the CPU runs torch")
        random_head = spec.algorithm == "eagle3" and self.load.format == "dummy"
        if spec.algorithm in ("draft", "eagle3") and not (spec.draft_model_path or random_head):
            raise ConfigError(
                f"speculative_algorithm {spec.algorithm} needs "
                "speculative_draft_model_path (the draft model or EAGLE-3 head folder)"
            )

    @classmethod
    def from_flags(cls, **flags: Any) -> EngineConfig:
        """The config the flat option names describe (the rest at their defaults); a name
        FLAG_FIELDS lacks raises TypeError naming it, a value of the wrong type or a bad
        value ConfigError naming the option."""
        unknown = sorted(set(flags) - set(FLAG_FIELDS))
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(FLAG_FIELDS)}")
        sections: dict[str, dict[str, Any]] = {f.name: {} for f in fields(cls)}
        types = flag_fields()
        for name, value in flags.items():
            section, attr = FLAG_FIELDS[name]
            sections[section][attr] = _typed(name, value, types[name].type)
        factories = {f.name: f.default_factory for f in fields(cls)}
        return cls(**{name: factories[name](**values) for name, values in sections.items()})

    def flags(self) -> dict[str, Any]:
        """Every option by its flat name, in FLAG_FIELDS order (`from_flags` takes them back)."""
        return {
            name: getattr(getattr(self, section), attr)
            for name, (section, attr) in FLAG_FIELDS.items()
        }

    def _auto_speculation(self) -> dict[str, Any]:
        """The embedded default model speculates with its shipped EAGLE-3 head (goodput
        policy) unless told otherwise; other models do not speculate unless asked."""
        if self.load.format == "dummy":
            return {"algorithm": None}  # random weights: nothing a shipped head was trained for
        if self.load.model is None and self.speculative.draft_model_path is None:
            head = shipped_head_path()
            if (head / "config.json").is_file():
                return {"algorithm": "eagle3", "draft_model_path": str(head)}
        return {"algorithm": None}

    def overlap_enabled(self) -> bool:
        """Whether the engine builds step N+1 while step N runs (default: on CUDA only,
        where the device runs ahead of the host; on the CPU nothing runs ahead)."""
        execution = self.execution
        if execution.disable_overlap_schedule or execution.overlap_schedule == "off":
            return False
        return execution.overlap_schedule == "on" or self.load.torch_device().type == "cuda"

    def backend_name(self) -> str:
        """The attention backend: the option, else triton on CUDA and torch on the CPU."""
        if self.execution.attention_backend != "auto":
            return self.execution.attention_backend
        return "triton" if self.load.torch_device().type == "cuda" else "torch"


def _number(kind: type) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, kind) and not isinstance(v, bool)


# A field's annotation (a string: `from __future__ import annotations`), part by part: what
# its values must be, and how a message says it. Python's int and float are the values the
# engine computes with, so numpy's numbers are taken as theirs; a bool is no number here.
_KINDS: dict[str, tuple[Callable[[Any], bool], Callable[[Any], Any], str]] = {
    "int": (_number(numbers.Integral), int, "an integer"),
    "float": (_number(numbers.Real), float, "a number"),
    "bool": (lambda v: isinstance(v, bool), bool, "True or False"),
    "str": (lambda v: isinstance(v, str), str, "a string"),
}


def _typed(name: str, value: Any, annotation: str) -> Any:
    """`value` of option `name` as its field's type says (numpy's numbers as Python's), else
    ConfigError naming the option: LLM's keywords come untyped (argparse types the CLI's),
    and a str, a float or a bool where an int belongs failed deep in the engine, or
    nowhere (max_num_seqs=2.5 ran)."""
    kinds = [part.strip() for part in annotation.split("|")]
    if value is None and "None" in kinds:
        return None
    for kind in kinds:
        if kind != "None" and _KINDS[kind][0](value):
            return _KINDS[kind][1](value)
    what = " or ".join([_KINDS[k][2] for k in kinds if k != "None"] + ["None"] * ("None" in kinds))
    raise ConfigError(f"{name} must be {what}; got {value!r}")


def flag_fields() -> dict[str, Field]:
    """Each flat option name's section field (its type and default), in FLAG_FIELDS order."""
    sections = {
        f.name: {g.name: g for g in fields(f.default_factory)} for f in fields(EngineConfig)
    }
    return {name: sections[section][attr] for name, (section, attr) in FLAG_FIELDS.items()}


def shipped_head_path() -> Path:
    """The EAGLE-3 head shipped for the embedded default model (SmolLM2-135M-Instruct);
    docs/eagle3_training.md says how it was trained."""
    return Path(__file__).resolve().parent.parent / "data" / "eagle3-smollm2-135m"
