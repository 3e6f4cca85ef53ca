"""Options of `specserve train-eagle3`, validated; the CLI flags derive from this dataclass."""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, dataclass, field, fields

from specserve.train.self_chat import check_temperatures

FEATURES = ("auto", "stored", "live")  # --features: where the target's features come from
DEFAULT_DRAFT_VOCAB = 16384  # a new head's draft vocabulary, when --draft-vocab-size is not given


@dataclass
class TrainConfig:
    """What to train on and how.

    Data: prompts from `data` (stdlib, shakespeare, self-chat, JSONL files), replies written
    by the target (greedy at temperature 0, else seeded sampling). Training: `steps`
    optimizer steps of `batch_size` samples, AdamW at `lr` with linear warm-up and cosine
    decay, `ttt_steps` unrolled steps per sample. Time budgets (seconds) stop generation
    early and make the learning-rate schedule follow the clock, training stopping when the
    budget is spent, so a run fits a fixed lease; the log records the counts reached.
    """

    out: str
    data: list[str] = field(default_factory=lambda: ["stdlib", "shakespeare"])
    data_weights: list[float] | None = None
    target: str | None = None
    steps: int = 1000
    batch_size: int = 16
    lr: float = 3e-4
    warmup_steps: int = 50
    ttt_steps: int = 7
    draft_vocab_size: int | None = None  # None: DEFAULT_DRAFT_VOCAB, or a checkpoint's
    num_prompts: int | None = None
    max_train_tokens: int | None = None
    features: str = "auto"
    self_chat_prompts: int = 2000
    self_chat_temperatures: list[float] = field(default_factory=lambda: [1.0])
    self_chat_opener_share: float = 0.0
    heldout_prompts: int = 64
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    max_seq_len: int = 1024
    temperature: float = 0.0
    seed: int = 0
    aux_layer_ids: list[int] | None = None
    init_head: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    gen_batch: int = 256
    feature_batch_tokens: int = 32768
    save_every: int = 200
    eval_every: int = 100
    gen_time_s: float | None = None
    train_time_s: float | None = None
    end_by: float | None = None
    prompt_variants: int = 1
    min_draft_coverage: float | None = None
    save_dtype: str = "bfloat16"
    resume: bool = False
    generate_only: bool = False
    append: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        positive = (
            "steps",
            "batch_size",
            "ttt_steps",
            "max_new_tokens",
            "max_prompt_tokens",
            "max_seq_len",
            "gen_batch",
            "feature_batch_tokens",
            "save_every",
            "eval_every",
            "prompt_variants",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1; got {self.draft_vocab_size}")
        if not 0 < self.lr < math.inf:  # (NaN too)
            raise ValueError(f"lr must be positive; got {self.lr}")
        for name in ("gen_time_s", "train_time_s"):
            seconds = getattr(self, name)
            if seconds is not None and not 0 < seconds < math.inf:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} must be a positive number of seconds (leave it out for no time "
                    f"limit); got {seconds}"
                )
        if self.features not in FEATURES:
            raise ValueError(f"features must be {', '.join(FEATURES)}; got {self.features!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if self.heldout_prompts < 0 or self.warmup_steps < 0 or self.self_chat_prompts < 0:
            raise ValueError("heldout_prompts, warmup_steps and self_chat_prompts must be >= 0")
        # (a list of floats, as the CLI gives it: the kept prompts' settings compare equal)
        self.self_chat_temperatures = [float(t) for t in self.self_chat_temperatures]
        check_temperatures(self.self_chat_temperatures)
        if not 0.0 <= self.self_chat_opener_share <= 1.0:
            raise ValueError(
                f"self_chat_opener_share must be in [0, 1]; got {self.self_chat_opener_share}"
            )
        if self.save_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(
                f"save_dtype must be bfloat16, float16 or float32; got {self.save_dtype!r}"
            )
        if self.min_draft_coverage is not None and not 0 < self.min_draft_coverage <= 1:
            raise ValueError(f"min_draft_coverage must be in (0, 1]; got {self.min_draft_coverage}")
        if self.min_draft_coverage is not None and self.init_head is not None:
            raise ValueError(
                "--min-draft-coverage chooses a new head's draft vocabulary; "
                "--init-head keeps its head's: give one of them"
            )
        if self.append and (self.resume or not self.generate_only):
            raise ValueError(
                "--append adds samples to --out's data.jsonl and stops: give it with "
                "--generate-only and without --resume (then train with --resume)"
            )
        if not self.data:
            raise ValueError("give at least one --data source")
        if self.data_weights is not None and (
            len(self.data_weights) != len(self.data) or min(self.data_weights) <= 0
        ):
            raise ValueError(
                f"--data-weights needs one positive weight per --data source "
                f"({len(self.data)}: {' '.join(self.data)}); got {self.data_weights}"
            )


_HELP = {
    "out": "output folder: the head (config.json, model.safetensors), data, log, checkpoint",
    "data": "prompt sources: stdlib, shakespeare, self-chat (user turns the target writes), "
    "or JSONL files of prompts/conversations",
    "data_weights": "one weight per --data source: each source's share of the training "
    "prompts, spread evenly through them (default: equal shares)",
    "target": "target model folder or .gguf (default: embedded SmolLM2-135M-Instruct)",
    "steps": "optimizer steps",
    "batch_size": "samples per step",
    "ttt_steps": "unrolled training-time-test steps",
    "draft_vocab_size": "draft vocabulary size (most frequent target tokens of the replies; "
    f"default {DEFAULT_DRAFT_VOCAB}, or the whole vocabulary of a smaller target; --resume "
    "keeps the checkpoint's)",
    "num_prompts": "cap on training prompts (default: all)",
    "max_train_tokens": "cap on the training samples' tokens (default: all; with stored "
    "features, on a GPU, as many as fit in 60%% of its memory left after the model, the rest "
    "being training's)",
    "features": "the target's features for training: stored (recorded once, about 4 x "
    "hidden size x dtype bytes a token on the device), live (the target runs on each batch: "
    "no memory bound on the data) or auto (stored where they fit, else live)",
    "self_chat_prompts": "prompts --data self-chat draws (seeded by --seed)",
    "self_chat_temperatures": "sampling temperatures of self-chat's user turns, one per draw "
    "in turn, a second turn at its conversation's (e.g. 0.7 1.0: lower ones write more "
    "coherent, more alike turns)",
    "self_chat_opener_share": "share of self-chat's first turns that start from a common "
    "question's first words (How do I, What is, Why do, ...), the target writing the rest",
    "heldout_prompts": "prompts kept out of training for the acceptance estimate",
    "temperature": "target's sampling temperature for the replies (0 = greedy)",
    "aux_layer_ids": "target layers whose input the head reads (default: 2, L//2, L-3)",
    "init_head": "start from this EAGLE-3 head (and its draft vocabulary) instead of a new one",
    "gen_time_s": "stop starting new prompts after this many seconds of generation (self-chat's "
    "turns included: they stop at half of it)",
    "train_time_s": "stop training after this many seconds (the schedule follows the clock)",
    "end_by": "stop training by this Unix time (shortens --train-time-s; for fixed leases)",
    "prompt_variants": "requests of different kinds per source text (stdlib, shakespeare); "
    "all first kinds come before any second one",
    "min_draft_coverage": "shrink the draft vocabulary (multiples of 1024, at most "
    "--draft-vocab-size) to the smallest holding this share of reply "
    "tokens",
    "resume": "continue from the checkpoint in --out (data and step restored)",
    "generate_only": "write the prompts' replies (data.jsonl) and stop; train on them later "
    "with --resume (fixed leases: generation and training in separate calls)",
    "append": "with --generate-only: add replies to --out's data.jsonl for the --data prompts "
    "whose text it does not hold yet (a new --seed draws new self-chat turns; texts the first "
    "run's seed holds out stay out), its held-out samples kept",
}


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, defaults taken from the dataclass."""
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        help_text = _HELP.get(f.name)
        if f.name == "progress":
            parser.add_argument(
                "--no-progress",
                dest="progress",
                action="store_false",
                help="no progress bars (default: shown)%(default).0s",  # (not "True")
            )
        elif f.type == "bool":
            parser.add_argument(flag, action="store_true", help=help_text)
        elif f.name in ("data", "data_weights", "aux_layer_ids", "self_chat_temperatures"):
            kind = {
                "data": str,
                "data_weights": float,
                "aux_layer_ids": int,
                "self_chat_temperatures": float,
            }[f.name]
            parser.add_argument(flag, nargs="+", type=kind, default=default, help=help_text)
        else:
            kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(
                f.type, str
            )
            parser.add_argument(
                flag,
                type=kind,
                default=default,
                required=f.default is MISSING and f.default_factory is MISSING,
                help=help_text,
            )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
