"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from specserve.core.errors import InvalidRequestError

GRAMMAR_KINDS = ("json", "json_schema", "regex", "ebnf")
_MASK_62 = (1 << 62) - 1


_INTS = ("max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "n", "min_tokens")
_REALS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def _int(x, low: int | None = None, high: int | None = None) -> bool:
    """Whether x is an integer (numpy's too; not a bool) within [low, high]."""
    if not isinstance(x, numbers.Integral) or isinstance(x, bool):
        return False
    return (low is None or x >= low) and (high is None or x <= high)


def _within(x, low: float, high: float, open_low: bool = False) -> bool:
    """Whether x is a real number (numpy's too; not a bool) in [low, high] ((low, high] if
    open_low)."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return False
    return (low < x if open_low else low <= x) and x <= high


def _as_list(x):
    """A collection of values as a list (None: empty); anything else as it is, for its
    field's check to refuse."""
    if x is None:
        return []
    if isinstance(x, (str, bytes, Mapping)) or not isinstance(x, Iterable):
        return x
    return list(x)


def engine_seed(seed: int) -> int:
    """The seed the engine draws with, in [0, 2**62) (an int64 on the device, with room for
    its stream offsets): `seed` itself in that range, else a hash of the whole integer. Wide
    seeds are taken (the OpenAI API's are any 64-bit integer, signed or not) and never
    alias one by wrapping (masked to 62 bits, -1 was 2**62 - 1)."""
    if 0 <= seed <= _MASK_62:
        return seed
    raw = seed.to_bytes(seed.bit_length() // 8 + 1, "little", signed=True)
    digest = hashlib.blake2b(raw, digest_size=8, person=b"specserve-seed").digest()
    return int.from_bytes(digest, "little") & _MASK_62


def choice_seed(seed: int, index: int) -> int:
    """Seed of choice `index` of a request with n choices: the request seed itself for the
    first, a splitmix64 hash of (seed, index) for the others, so seeded n > 1 requests
    reproduce (the server's and LLM.generate's alike)."""
    if index == 0:
        return seed
    if not 0 <= seed < 1 << 64:  # (as 64 bits, -1 would be 2**64 - 1)
        seed = engine_seed(seed)
    z = (seed + 0x9E3779B97F4A7C15 * index) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK_62


@dataclass(frozen=True)
class Grammar:
    """What the output must match: any JSON value (`json`), the JSON schema given as a JSON
    string (`json_schema`), a regular expression (`regex`) or an EBNF grammar (`ebnf`, in
    xgrammar's dialect: `root ::= ...`). A JSON schema's value may sit between fixed texts
    (`prefix`, `suffix`: a tool call's tags).

    `compiled`: the grammar as compiled for the model's tokenizer (xgrammar's serialized
    form) where a process with that tokenizer compiled it already (the server's HTTP
    process): the engine loads it instead of compiling it again on its step loop (a schema
    with a repeat count in the thousands takes seconds)."""

    kind: str
    source: str = ""
    field: str = field(default="grammar", compare=False)  # what errors name (the API's field)
    prefix: str = ""
    suffix: str = ""
    compiled: str | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str, str, str]:
        """What makes two grammars the same (caches)."""
        return self.kind, self.source, self.prefix, self.suffix

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequestError(
                f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}; got {self.kind!r}",
                field=self.field,
            )
        if self.kind != "json" and not (isinstance(self.source, str) and self.source):
            raise InvalidRequestError(f"a {self.kind} grammar needs its source", field=self.field)
        if (self.prefix or self.suffix) and self.kind != "json_schema":
            raise InvalidRequestError(
                "prefix and suffix go only with a json_schema grammar", field=self.field
            )


@dataclass
class SamplingParams:
    """How to sample one request. The defaults are `specserve generate`'s: greedy decoding
    (temperature 0: always the likeliest token) of at most 128 new tokens.

    Why not vLLM's defaults (temperature 1.0, 16 tokens): sampled at temperature 1, a small
    instruct model such as the embedded SmolLM2 rambles, and 16 tokens cut most answers
    short; greedy output is also reproducible and, with speculation on, exactly the plain
    decoding's. The HTTP server follows the OpenAI API instead (temperature 1.0 unless the
    request says otherwise).

    top_k 0 (or -1) disables top-k; top_p 1.0 and min_p 0.0 disable their filters.
    `seed` makes sampled output reproducible: the random draws depend only on the seed and the
    token's position, never on batch composition or preemption (without one, the engine draws
    a seed from its own `seed`). `stop` strings end the output and are not part of it;
    `logprobs=k` puts the chosen token's log-probability and the k likeliest alternatives of
    every generated token in `CompletionOutput.logprobs`, and `prompt_logprobs=k` those of
    every prompt token after the first in `CompletionOutput.prompt_logprobs` (the prompt is
    then computed whole: no prefix cache hit). `logit_bias` ({token id: bias in
    [-100, 100]}) is added to those tokens' logits before every draw, and `min_tokens` keeps
    EOS and the stop tokens from being drawn before that many tokens are generated; both
    apply to every row speculation verifies too, so greedy output stays the plain decoding's.
    `presence_penalty` and `frequency_penalty` (OpenAI's, in [-2, 2]) lower a token's logit
    once if it was generated already and once per time it was; `repetition_penalty` (> 0,
    1 is off; transformers' and vLLM's) divides a positive logit, multiplies a negative one,
    of every token in the prompt or the output. A verified draft counts for the rows after
    it, as it would have in plain decoding. `grammar` (a Grammar) constrains the output to
    JSON, a JSON schema or a regular expression: every row's distribution is masked to the
    tokens the grammar allows there (runtime/grammar.py), drafts included.

    Example: `SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=1)`.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's plus the top k
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field and bring it to its normal form (a lone stop string as a list,
        top_k -1 as 0, numpy's numbers as Python's); raises InvalidRequestError naming the
        first bad field. The engine calls it again when a request is added, so a field
        changed after construction is checked as the constructor checks it (the server sets
        `grammar` after construction, so these params stay mutable)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list(self.stop)
        self.stop_token_ids = _as_list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.logit_bias, Mapping):
            self.logit_bias = dict(self.logit_bias) or None
        bias = self.logit_bias if isinstance(self.logit_bias, dict) else {}
        # (each check a callable, run in order: a later one may read what an earlier one
        # checked; booleans are no integers here, and a value of the wrong kind fails its
        # own check rather than raising inside another's comparison)
        checks = [
            ("max_tokens", lambda: _int(self.max_tokens, 1), "must be an integer >= 1"),
            ("temperature", lambda: _within(self.temperature, 0.0, 100.0), "must be in [0, 100]"),
            (
                "top_k",
                lambda: _int(self.top_k, 0),
                "must be a non-negative integer (0 or -1 disables it)",
            ),
            ("top_p", lambda: _within(self.top_p, 0.0, 1.0, open_low=True), "must be in (0, 1]"),
            ("min_p", lambda: _within(self.min_p, 0.0, 1.0), "must be in [0, 1]"),
            ("seed", lambda: self.seed is None or _int(self.seed), "must be an integer"),
            (
                "logprobs",
                lambda: self.logprobs is None or _int(self.logprobs, 0, 20),
                "must be an integer in [0, 20]",
            ),
            (
                "prompt_logprobs",
                lambda: self.prompt_logprobs is None or _int(self.prompt_logprobs, 0, 20),
                "must be an integer in [0, 20]",
            ),
            ("n", lambda: _int(self.n, 1, 128), "must be an integer in [1, 128]"),
            (
                "stop",
                lambda: (
                    isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop)
                ),
                "must be non-empty strings",
            ),
            (
                "stop_token_ids",
                lambda: (
                    isinstance(self.stop_token_ids, list)
                    and all(_int(t, 0) for t in self.stop_token_ids)
                ),
                "must be non-negative integers",
            ),
            ("ignore_eos", lambda: isinstance(self.ignore_eos, bool), "must be True or False"),
            (
                "logit_bias",
                lambda: (
                    (self.logit_bias is None or isinstance(self.logit_bias, dict))
                    and all(_int(t, 0) for t in bias)
                    and all(_within(b, -100.0, 100.0) for b in bias.values())
                ),
                "must map non-negative token ids to biases in [-100, 100]",
            ),
            (
                "presence_penalty",
                lambda: _within(self.presence_penalty, -2.0, 2.0),
                "must be in [-2, 2]",
            ),
            (
                "frequency_penalty",
                lambda: _within(self.frequency_penalty, -2.0, 2.0),
                "must be in [-2, 2]",
            ),
            (
                "repetition_penalty",
                lambda: _within(self.repetition_penalty, 0.0, 10.0, open_low=True),
                "must be in (0, 10]",
            ),
            (
                "grammar",
                lambda: self.grammar is None or isinstance(self.grammar, Grammar),
                "must be a Grammar, such as Grammar('json'), or None",
            ),
            (
                "min_tokens",
                lambda: _int(self.min_tokens, 0, self.max_tokens),
                "must be an integer in [0, max_tokens]",
            ),
            (
                "min_tokens",
                lambda: not (self.min_tokens and self.grammar is not None),
                "cannot be combined with a grammar (its end may come first)",
            ),
        ]
        for name, ok, what in checks:
            if not ok():
                raise InvalidRequestError(f"{name} {what}; got {getattr(self, name)!r}", field=name)
        for name in _INTS:  # (numpy's numbers as Python's: seeds are hashed, ids compared)
            value = getattr(self, name)
            if value is not None and type(value) is not int:
                setattr(self, name, int(value))
        for name in _REALS:
            if type(getattr(self, name)) is not float:
                setattr(self, name, float(getattr(self, name)))
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.logit_bias:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}

    @property
    def penalized(self) -> bool:
        """Whether a draw depends on the tokens so far (the penalties)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits are changed before a draw (`logit_bias`, `min_tokens`, the
        penalties, a grammar)."""
        return (
            bool(self.logit_bias)
            or self.min_tokens > 0
            or self.penalized
            or self.grammar is not None
        )

    @property
    def greedy(self) -> bool:
        """Temperature 0: the likeliest token, no random draw."""
        return self.temperature == 0.0
