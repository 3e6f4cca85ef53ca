"""`--data self-chat`: chat prompts the target writes itself, so a head learns on what people
ask without any download (the Magpie recipe: rendered up to where a user's turn begins, an
instruction-tuned model writes a user's question).

Each candidate is the chat template rendered with an empty conversation (or one exchange,
for a second turn) up to the first character of a new user message, continued by the target
(seeded sampling at `temperatures`, one per draw in turn) until its end-of-turn token. A
turn is kept when it ended there (not by length), is long enough, holds no special token's
text (a template leaking into the turn) and is new: duplicates (case and spacing aside) are
dropped. A share of the kept turns (`multi_turn_share`, chosen by the seed) becomes a
two-turn conversation: the target answers the first turn (greedy) and writes the next user
turn after its answer; the distillation then writes its reply to that. Candidates are drawn
in rounds until `count` prompts are kept or `max_attempts` candidates were tried. A share of
first turns (`opener_share`) starts from a common question's first words (`OPENERS`), which
the target continues: the turn is the opener and what it wrote.

Deterministic under a seed: every candidate's sampling seed is a hash of the source's seed
and its index (`draw_seed`), and the engine's seeded draws do not depend on the batch.
"""

from __future__ import annotations

import hashlib
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.core.errors import SpecserveError
from specserve.core.sampling_params import SamplingParams
from specserve.train.prompts import PromptItem

SELF_CHAT = "self-chat"  # the --data name
_SENTINEL = "SPECSERVE_SELF_CHAT_TURN_4f1c"  # plain text a template copies as it is

# (token ids, finish reason) per prompt, in order: how candidates are generated
Generate = Callable[[list[list[int]], list[SamplingParams]], list[tuple[list[int], str | None]]]


class SelfChatError(SpecserveError):
    """The target's chat template cannot render a user turn for the target to write."""


@dataclass
class SelfChatConfig:
    """How many prompts and how they are drawn (see the module docstring)."""

    count: int
    seed: int = 0
    # Draw i samples at temperatures[i % len]: SmolLM2-135M's turns at 1.0 are varied and
    # often odd (role-play openings, garbled requests), at 0.6 coherent everyday requests
    # that repeat themselves (career changes, trip plans, top-5 lists); a mix has both.
    temperatures: tuple[float, ...] = (1.0,)
    # This share of first turns begins with one of OPENERS (chosen by the seed), the target
    # writing the rest: a small target's own turns are mostly requests ("Can you provide",
    # "I'm planning to"), rarely the short questions people ask ("How do I ...?").
    opener_share: float = 0.0
    top_p: float = 0.95
    max_turn_tokens: int = 128
    answer_tokens: int = 256
    multi_turn_share: float = 0.25
    min_chars: int = 12
    min_words: int = 3
    batch: int = 256
    max_attempts: int | None = None  # default: 8 x count
    # no round of candidates is drawn past this time.monotonic() (the turns kept stay)
    deadline: float | None = None

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"self-chat prompts must be >= 0; got {self.count}")
        if not 0.0 <= self.multi_turn_share <= 1.0:
            raise ValueError(f"multi_turn_share must be in [0, 1]; got {self.multi_turn_share}")
        check_temperatures(self.temperatures)
        if not 0.0 <= self.opener_share <= 1.0:
            raise ValueError(f"opener_share must be in [0, 1]; got {self.opener_share}")


def check_temperatures(temperatures) -> None:
    """Self-chat's sampling temperatures: at least one, each in (0, 100] (0, greedy, would
    write one turn over and over; the sampler takes at most 100)."""
    if not temperatures or not all(0.0 < t <= 100.0 for t in temperatures):
        raise ValueError(
            "--self-chat-temperatures must be one or more numbers in (0, 100] (0 is greedy: "
            f"every draw would write the same turn); got {list(temperatures)}"
        )


def openers_tag() -> str:
    """A short digest of OPENERS: kept prompts drawn with another list are drawn again."""
    return hashlib.sha1("|".join(OPENERS).encode()).hexdigest()[:12]


# How people start a question or a request, for `opener_share`: generic English stems.
# (Most of the hand-written everyday questions eval-draft measures also start with one: a
# head's gain there from such turns is partly their form; docs/eagle3_training.md.)
MIN_AFTER_OPENER = 2  # words the target writes after an opener, at least
OPENERS = (
    "How do I",
    "How can I",
    "How does",
    "How many",
    "What is",
    "What are",
    "What should I",
    "What's the best way to",
    "Why do",
    "Why is",
    "Can you explain",
    "Can you help me",
    "Is it",
    "Should I",
    "Which",
    "When should I",
    "Where can I",
    "Tell me about",
    "Give me",
    "Explain",
    "Write",
    "I need",
    "Help me",
    "Do you",
)


@dataclass
class SelfChatReport:
    """What drawing the prompts took: candidates tried and why the others were dropped."""

    attempts: int = 0
    kept: int = 0
    opened: int = 0  # kept first turns that begin with an opener (`opener_share`)
    multi_turn: int = 0
    out_of_time: bool = False  # the deadline stopped the draws before `count`
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def user_turn_prefix(tokenizer, history: list[dict]) -> list[int]:
    """Token ids of the chat template rendered after `history` up to where a new user
    message's text begins (the template's own system prompt, if it adds one, included)."""
    text = tokenizer.apply_chat_template(
        [*history, {"role": "user", "content": _SENTINEL}],
        tokenize=False,
        add_generation_prompt=False,
    )
    cut = text.find(_SENTINEL) if isinstance(text, str) else -1
    if cut < 0:
        raise SelfChatError(
            "--data self-chat: the target's chat template does not copy a user message's text "
            "as it is, so the target cannot be asked to write one"
        )
    return list(tokenizer(text[:cut], add_special_tokens=False)["input_ids"])


def special_texts(tokenizer) -> tuple[str, ...]:
    """The text of every special and added token (a turn holding one is template-broken)."""
    names = set(getattr(tokenizer, "all_special_tokens", []) or [])
    added = getattr(tokenizer, "get_added_vocab", None)
    if added is not None:
        names |= set(added())
    return tuple(sorted(n for n in names if n and not n.isspace()))


def clean_turn(text: str, specials: tuple[str, ...], cfg: SelfChatConfig) -> tuple[str, str]:
    """(the turn's text, "") when it may be a user's turn, else ("", why not)."""
    text = text.strip()
    if not text:
        return "", "empty"
    if any(s in text for s in specials):
        return "", "template"
    if len(text) < cfg.min_chars or len(text.split()) < cfg.min_words:
        return "", "short"
    return text, ""


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip(" .?!")


def _key(text: str) -> str:
    return f"{SELF_CHAT}/{hashlib.sha1(text.encode()).hexdigest()[:16]}"


def engine_generate(engine) -> Generate:
    """Candidates through a specserve LLMEngine (continuous batching): every prompt at once,
    stepped until each one finished; (token ids, finish reason) in prompt order."""

    def generate(prompts, params):
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, tuple[list[int], str | None]] = {}
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (list(out.token_ids), out.finish_reason)
            if not engine.has_unfinished() and len(done) < len(ids):
                raise RuntimeError("the engine stopped before every self-chat candidate finished")
        return [done[i] for i in ids]

    return generate


def self_chat_prompts(
    tokenizer, generate: Generate, cfg: SelfChatConfig, report: SelfChatReport | None = None
) -> list[PromptItem]:
    """`cfg.count` prompts (fewer if `cfg.max_attempts` candidates run out first), in the
    order they were drawn; `report` gets the counts."""
    report = report if report is not None else SelfChatReport()
    specials = special_texts(tokenizer)
    first_prefix = user_turn_prefix(tokenizer, [])
    max_attempts = cfg.max_attempts if cfg.max_attempts is not None else 8 * cfg.count
    rng = random.Random(cfg.seed)
    seen: set[str] = set()
    turns: list[str] = []
    opener_ids = {o: tokenizer.encode(o, add_special_tokens=False) for o in OPENERS}
    while len(turns) < cfg.count and report.attempts < max_attempts:
        if cfg.deadline is not None and time.monotonic() >= cfg.deadline:
            report.out_of_time = True
            break
        n = min(cfg.batch, max_attempts - report.attempts)
        draws = range(report.attempts, report.attempts + n)
        params = [_turn_params(cfg, d) for d in draws]
        openers = [draw_opener(cfg, d) for d in draws]
        report.attempts += n
        prompts = [first_prefix + opener_ids[o] if o else first_prefix for o in openers]
        for opener, (ids, reason) in zip(openers, generate(prompts, params)):
            text, why = _turn(tokenizer, ids, reason, specials, cfg, opener_ids.get(opener, ()))
            if not why and _normal(text) in seen:
                why = "duplicate"
            if why:
                report.drop(why)
                continue
            if len(turns) == cfg.count:  # (the last round drew more than were needed)
                report.drop("surplus")
                continue
            seen.add(_normal(text))
            turns.append(text)
            report.opened += bool(opener)
    conversations = [[{"role": "user", "content": t}] for t in turns]
    second = [i for i in range(len(turns)) if rng.random() < cfg.multi_turn_share]
    if second:
        _second_turns(tokenizer, generate, cfg, conversations, second, specials, seen, report)
    report.kept = len(conversations)
    report.multi_turn = sum(len(c) > 1 for c in conversations)
    return [PromptItem(_key(c[0]["content"]), c) for c in conversations]


def draw_seed(seed: int, draw) -> int:
    """The sampling seed of one draw under the run's `seed`: a hash of both, so runs of
    neighbouring seeds share no draw (seed + index shared all but one)."""
    digest = hashlib.blake2b(f"{seed}/{draw}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def draw_opener(cfg: SelfChatConfig, draw: int) -> str:
    """The opener first-turn draw number `draw` begins with ("" for none), by the seed."""
    if not cfg.opener_share:
        return ""
    pick = draw_seed(cfg.seed, f"opener {draw}")
    if (pick % 10_000) / 10_000 >= cfg.opener_share:
        return ""
    return OPENERS[pick // 10_000 % len(OPENERS)]


def _turn_params(cfg: SelfChatConfig, draw: int, name: str = "") -> SamplingParams:
    """Draw number `draw`'s sampling (a second turn's: named after its conversation)."""
    temps = cfg.temperatures
    return SamplingParams(
        max_tokens=cfg.max_turn_tokens,
        temperature=temps[draw % len(temps)],
        top_p=cfg.top_p,
        seed=draw_seed(cfg.seed, name or draw),
    )


def _text(tokenizer, ids: list[int], specials: tuple[str, ...]) -> str:
    """Generated ids as text, special tokens kept (a template token inside is breakage, not
    to be hidden) except those ending it (the end-of-turn token that stopped it)."""
    text = tokenizer.decode(ids, skip_special_tokens=False).strip()
    while ends := [s for s in specials if text.endswith(s)]:
        text = text[: -len(ends[0])].rstrip()
    return text


def _turn(tokenizer, ids, reason, specials, cfg, opener_ids=()) -> tuple[str, str]:
    """A generated user turn's text (its opener's tokens, if it had one, then the target's),
    or why it is dropped: after an opener the target's own part must hold two words (a bare
    stem such as "Can you explain" is not a question)."""
    if reason != "stop":
        return "", "unfinished"
    if opener_ids and len(_text(tokenizer, ids, specials).split()) < MIN_AFTER_OPENER:
        return "", "short"
    return clean_turn(_text(tokenizer, [*opener_ids, *ids], specials), specials, cfg)


def _second_turns(tokenizer, generate, cfg, conversations, chosen, specials, seen, report):
    """The chosen one-turn conversations grow an answer (greedy) and a second user turn;
    those whose second turn is dropped stay one turn long."""
    from specserve.train.distill import chat_ids

    answers = generate(
        [chat_ids(tokenizer, conversations[i]) for i in chosen],
        [SamplingParams(max_tokens=cfg.answer_tokens, temperature=0.0) for _ in chosen],
    )
    grown, prefixes = [], []
    for i, (ids, reason) in zip(chosen, answers):
        answer = _text(tokenizer, ids, specials)
        if reason != "stop" or not answer or any(s in answer for s in specials):
            report.drop("answer")
            continue
        history = [*conversations[i], {"role": "assistant", "content": answer}]
        grown.append((i, history))
        prefixes.append(user_turn_prefix(tokenizer, history))
    params = [_turn_params(cfg, i, f"second {i}") for i, _ in grown]
    for (i, history), (ids, reason) in zip(grown, generate(prefixes, params)):
        text, why = _turn(tokenizer, ids, reason, specials, cfg)
        if not why and _normal(text) in seen:
            why = "duplicate"
        if why:
            report.drop(f"second turn {why}")
            continue
        seen.add(_normal(text))
        conversations[i] = [*history, {"role": "user", "content": text}]
