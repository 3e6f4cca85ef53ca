"""The engine's command-line flags: one per flat EngineConfig option (FLAG_FIELDS), defaults
from its section's dataclass, in groups read in order (model, sampling, speculation,
performance, advanced), each with one line of help; specserve's parser class (defaults in the
help, a short usage line); and config errors worded with the flags as users type them."""

from __future__ import annotations

import argparse
import copy
import re
from contextlib import contextmanager
from dataclasses import MISSING

from specserve.core.config import FLAG_FIELDS, EngineConfig, flag_fields
from specserve.core.config_sections import (
    ATTENTION_BACKEND_CHOICES,
    DTYPE_CHOICES,
    HEAD_PARALLEL_CHOICES,
    LOAD_FORMATS,
    OVERLAP_SCHEDULE_CHOICES,
    SPECULATIVE_ALGORITHM_CHOICES,
    SPECULATIVE_POLICY_CHOICES,
)

GROUPS = {  # title -> one line under it, in the order the help shows them
    "model": "what to run, and where",
    "sampling": "how tokens are chosen",
    "speculation": "speculative decoding: draft tokens cheaply, verify them in one pass",
    "performance": "memory and batching",
    "advanced": "GPU kernels and the step loop; the defaults suit nearly every use",
}

# flat option -> (group, help). Help is a user's sentence: what the flag does, and its default
# where the default is not a plain value the formatter can show.
_FLAGS: dict[str, tuple[str, str]] = {
    "model": (
        "model",
        "Hugging Face model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    ),
    "load_format": (
        "model",
        "auto reads the weights; dummy builds random weights of the "
        "model's shape, for benchmarks (--model may then name a preset: "
        "llama-3.1-8b, smollm2-135m, or llama-3.1-70b, whose 141 GB of bf16 "
        "weights need more than one GPU), or a config.json",
    ),
    "dtype": ("model", "compute precision; auto: float32 on CPU, the checkpoint's own on GPU"),
    "device": ("model", "where to run: auto (a GPU when there is one), cpu, cuda or cuda:N"),
    "max_model_len": (
        "model",
        "longest prompt plus output, in tokens (default: the model's context length)",
    ),
    "seed": ("sampling", "seed of the random draws of requests that bring no seed of their own"),
    "tensor_parallel_size": (
        "performance",
        "GPUs to shard the model over (tensor parallelism), one process each; alias --tp",
    ),
    "nnodes": (
        "advanced",
        "machines the tensor-parallel ranks run on (each runs --tensor-parallel-size / "
        "--nnodes of them)",
    ),
    "node_rank": (
        "advanced",
        "this machine's index among --nnodes: 0 runs the scheduler and serves; the others "
        "run their ranks and follow it",
    ),
    "dist_init_addr": (
        "advanced",
        "host:port of machine 0 where every rank meets (needed with --nnodes > 1)",
    ),
    "debug_tp_check": (
        "advanced",
        "under tensor parallelism, compare every step's tokens across the ranks and stop at "
        "the first difference (slow: for debugging)",
    ),
    "speculative_algorithm": (
        "speculation",
        "how to draft: auto uses the shipped EAGLE-3 head "
        "with the embedded model and nothing with others; eagle3 and "
        "draft need --speculative-draft-model-path; ngram copies from "
        "the prompt; none turns speculation off",
    ),
    "speculative_draft_model_path": (
        "speculation",
        "EAGLE-3 head folder, or a small model "
        "with the target's tokenizer (default: the shipped head "
        "for the embedded model)",
    ),
    "speculative_num_steps": ("speculation", "most draft tokens per request and step (K_max)"),
    "speculative_policy": (
        "speculation",
        "how many tokens to draft each step: goodput picks "
        "the fastest from measured costs, fixed always drafts "
        "--speculative-num-steps, schedule follows --speculative-schedule, "
        "off never drafts (default: goodput with a drafter)",
    ),
    "speculative_schedule": (
        "advanced",
        "draft length by batch size for the schedule policy, e.g. 1:4,16:2,64:0 (default: none)",
    ),
    "speculative_trace_file": (
        "advanced",
        "write the speculation policy's last 4,096 decisions (each step's K, what the "
        "policy expected of every K, the measured period) and its tables as JSON to this "
        "file when the engine stops (default: none)",
    ),
    "page_size": ("advanced", "tokens per KV cache page"),
    "kv_cache_bytes": (
        "advanced",
        "KV cache size in bytes, the drafter's KV included (default: 256 MiB on CPU; on "
        "a GPU, --kv-cache-memory-fraction of its free memory)",
    ),
    "kv_cache_memory_fraction": (
        "performance",
        "on a GPU, without --kv-cache-bytes: the share "
        "of the memory left free by the weights that the KV cache "
        "takes",
    ),
    "num_kv_pages": (
        "advanced",
        "KV cache size in pages, instead of bytes (default: from --kv-cache-bytes)",
    ),
    "disable_prefix_caching": (
        "advanced",
        "free a request's KV pages when it ends, instead of keeping them for later requests "
        "that begin with the same tokens (a shared system prompt, earlier turns of a chat)",
    ),
    "max_num_seqs": ("performance", "most requests running at once"),
    "max_num_batched_tokens": (
        "performance",
        "most tokens one step processes; longer prompts are read in chunks",
    ),
    "speculative_simulate_acceptance": (
        "advanced",
        "BENCHMARKING ONLY: accept drafts by "
        "seeded random draws (a rate per token up to 1, or a "
        "mean acceptance length above 1); the output is not "
        "the model's (default: off)",
    ),
    "speculative_head_parallel": (
        "advanced",
        "under tensor parallelism, an EAGLE-3 head whole on every rank (no collective "
        "per draft pass) or sharded like the model (its fc whole)",
    ),
    "attention_backend": ("advanced", "attention kernels; auto: triton on a GPU, torch on CPU"),
    "overlap_schedule": (
        "advanced",
        "prepare the next step on the CPU while the GPU runs this "
        "one; auto: on with a GPU, off on CPU",
    ),
    "disable_overlap_schedule": ("advanced", argparse.SUPPRESS),  # = --overlap-schedule off
    "disable_cuda_graph": (
        "advanced",
        "run every GPU step eagerly, without CUDA graphs (slower; for debugging)",
    ),
    "cuda_graph_max_batch": (
        "advanced",
        "largest batch captured as a CUDA graph; larger batches run eagerly",
    ),
    "cuda_graph_max_tokens": (
        "advanced",
        "largest step that mixes prefill chunks with decode rows captured as a CUDA graph, "
        "in tokens; larger ones run eagerly; 0: all eagerly",
    ),
    "grammar_workers": (
        "advanced",
        "processes that fill structured output's token masks beside the engine (default: "
        "up to 4 with a GPU, a quarter of the CPU cores; none on CPU); 0: the engine fills them",
    ),
    "disable_gemv": (
        "advanced",
        "use cuBLAS for every linear layer instead of choosing "
        "Triton kernels at start-up (the same kernels on every start)",
    ),
    "disable_gemv_tuning": (
        "advanced",
        "keep the kernels chosen by timing each layer alone, "
        "without timing them again in whole steps (shorter start-up)",
    ),
    "disable_batch_invariance": (
        "advanced",
        "allow faster kernels whose rounding changes "
        "with the batch size (greedy output with speculation may "
        "then differ from plain decoding)",
    ),
    "disable_verify_tiles": (
        "advanced",
        "skip the start-up search for faster kernels for "
        "speculative verify steps (shorter start-up)",
    ),
    "disable_pdl": (
        "advanced",
        "launch GPU kernels strictly one after another, without "
        "programmatic dependent launch (Hopper GPUs and later)",
    ),
    "gemv_stream_k": (
        "advanced",
        "EXPERIMENTAL: also try stream-K kernels for steps of more than 16 rows at start-up",
    ),
    "disable_fusion": (
        "advanced",
        "run SiLU-and-mul and split-K reductions as kernels of "
        "their own (the same results, slower)",
    ),
}

_ALIASES = {"tensor_parallel_size": ("--tp",)}

_CHOICES = {
    "load_format": LOAD_FORMATS,
    "dtype": DTYPE_CHOICES,
    "speculative_algorithm": SPECULATIVE_ALGORITHM_CHOICES,
    "speculative_policy": SPECULATIVE_POLICY_CHOICES,
    "speculative_head_parallel": HEAD_PARALLEL_CHOICES,
    "attention_backend": ATTENTION_BACKEND_CHOICES,
    "overlap_schedule": OVERLAP_SCHEDULE_CHOICES,
}

_METAVARS = {
    "model": "PATH",
    "speculative_draft_model_path": "PATH",
    "device": "DEVICE",
    "speculative_schedule": "TABLE",
    "speculative_trace_file": "PATH",
    "kv_cache_bytes": "BYTES",
    "speculative_simulate_acceptance": "RATE|LEN",
    "dist_init_addr": "HOST:PORT",
}

ENGINE_FLAGS = {name: "--" + name.replace("_", "-") for name in FLAG_FIELDS}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help, except where the help says it already, where
    there is none (None) and for switches (off unless given)."""

    @staticmethod
    def _has_default(action: argparse.Action) -> bool:
        default = action.default
        return bool(action.option_strings) and not (
            default is None or default is False or default is argparse.SUPPRESS
        )

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not self._has_default(action):
            return text
        return super()._get_help_string(action)

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._has_default(action):  # no help: still its default
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)


class ArgumentParser(argparse.ArgumentParser):
    """specserve's parsers (subcommands included): defaults shown, and a usage line that
    names the positionals and says [options] rather than listing forty flags."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    @contextmanager
    def _short_usage(self):
        if self.usage is not None:
            yield
            return
        formatter = self._get_formatter()
        positionals = [
            formatter._format_args(a, a.dest) for a in self._actions if not a.option_strings
        ]
        self.usage = " ".join(["%(prog)s", "[options]", *positionals])
        try:
            yield
        finally:
            self.usage = None

    def format_usage(self) -> str:
        """The usage line (errors print it)."""
        with self._short_usage():
            return super().format_usage()

    def format_help(self) -> str:
        """The help, with the short usage line."""
        with self._short_usage():
            return super().format_help()


def engine_arg_groups(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """The help's groups, in their order, for a command to add its own flags to."""
    return {title: parser.add_argument_group(title, about) for title, about in GROUPS.items()}


def add_engine_args(
    parser: argparse.ArgumentParser, groups: dict[str, argparse._ArgumentGroup] | None = None
) -> dict[str, argparse._ArgumentGroup]:
    """One flag per flat EngineConfig option, its default taken from its section's
    dataclass, in its group (`groups`, else new ones); returns the groups."""
    groups = groups or engine_arg_groups(parser)
    for name, f in flag_fields().items():
        group, help_text = _FLAGS[name]
        add = groups[group].add_argument
        flag = ENGINE_FLAGS[name]
        aliases = _ALIASES.get(name, ())
        annotation = str(f.type)
        if annotation == "bool":
            add(flag, action="store_true", help=help_text)
            continue
        default = None if f.default is MISSING else f.default
        kind = str if "str" in annotation else float if "float" in annotation else int
        metavar = None if name in _CHOICES else _METAVARS.get(name, "N" if kind is int else "X")
        add(
            flag,
            *aliases,
            type=kind,
            default=default,
            choices=_CHOICES.get(name),
            metavar=metavar,
            help=help_text,
        )
    return groups


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the parsed engine flags describe (raises ConfigError)."""
    return EngineConfig.from_flags(**{name: getattr(args, name) for name in FLAG_FIELDS})


def has_engine_args(args: argparse.Namespace) -> bool:
    """Whether the command took the engine flags."""
    return all(hasattr(args, name) for name in ENGINE_FLAGS)


def flag_message(message: str, flags: dict[str, str]) -> str:
    """`message` with the option names it mentions written as the flags users type
    (`flags`: name -> flag): names with an underscore wherever they stand, one-word names
    (model, device, seed...) only where they open the message, since elsewhere they are
    likely plain words."""
    for name, flag in flags.items():
        if "_" in name:
            message = re.sub(rf"\b{name}\b", flag, message)
    first = message.split(" ", 1)[0]
    if first in flags:
        message = flags[first] + message[len(first) :]
    return message
