"""Recently encoded long prompts, so that a prompt starting like one of them is encoded as
that one's token ids up to a cut plus its own rest (issue 31: a 2,048-token system prompt, or a
conversation's history, is tokenized once, not with every request that repeats it).

Why the ids are exactly `encode`'s: a Rust tokenizer splits a text at its added tokens,
normalizes each piece, splits it into words (the pre-tokenizer), and its model encodes each
word on its own; the post-processor puts special tokens around the whole. Cut the new text
at a character where the cached text's words split, with the two texts the same for
`margin` characters past it (the split patterns look a character or two ahead; an added
token as far as it is long): the new text's words split there too, and its rest encoded
alone gives the ids the whole would have past the cut. Which side of a space a word starts
on depends on the tokenizer: byte-level BPE keeps the space with the word after it (a cut
goes before a space), whitespace splitting drops it (a cut goes after one): RULES, each
between a character that is not a space and a letter or digit. Some tokenizers treat a
piece's start specially: they prepend a marker to every piece (Llama 2's legacy
normalizer), strip it, or add a token after the text. So `check` tries each rule when the
encoder is built, at every cut it allows in texts putting each of many pieces (and the
tokenizer's own tokens) on either side of a space, and on random texts sharing prefixes,
against their whole encodings; a tokenizer that fails both gets no cache.

The entries keep each token's character span (the Rust tokenizer's offsets), to find a
cut's token. A long text without a usable predecessor is encoded without offsets (the fast
path) and kept with ids only; its spans are worked out the first time a later text shares a
long prefix with it.
"""

from __future__ import annotations

import random
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict

MIN_CHARS = 1024  # texts at least this long are kept, and looked up (shorter: encoded whole)
MIN_CUT = 512  # a shared prefix shorter than this is encoded again (it would save little)
CUT_MARGIN = 16  # characters the cut stays before the end of what the two texts share, at
# least (and past the tokenizer's longest added token: `margin`)
KEPT = 256  # recent texts kept (least recently used out first)
KEPT_CHARS = 8 << 20  # ... characters in all
KEPT_TOKENS = 2 << 20  # ... and tokens (12 bytes each: ~24 MB of ids and spans)
BLOCK = 256  # characters a block: texts are found by the hashes of their leading blocks
_SEARCH = 64  # tokens a cut is looked for before giving up


def _before_space(text: str, at: int) -> bool:
    """A space between a character that is not one and a letter or digit."""
    return text[at] == " " and text[at + 1].isalnum() and not text[at - 1].isspace()


def _after_space(text: str, at: int) -> bool:
    """A letter or digit after a space after a character that is not one."""
    return text[at - 1] == " " and text[at].isalnum() and not text[at - 2].isspace()


RULES = {"before-space": _before_space, "after-space": _after_space}


def block_hashes(text: str) -> list[int]:
    """A hash of each of `text`'s whole leading BLOCKs together with all before it: two
    texts' k-th hashes are equal when (hash collisions aside) their first k blocks are."""
    hashes, h = [], 0
    for start in range(0, len(text) - BLOCK + 1, BLOCK):
        h = hash((h, text[start : start + BLOCK]))
        hashes.append(h)
    return hashes


def common_prefix(a: str, b: str) -> int:
    """Characters `a` and `b` share from the start (a binary search of slices compared in
    C: ~the shorter text's length copied in all)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.startswith(b[lo:mid], lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Entry:
    """A text's ids (with the special tokens `add_special_tokens` put in), and each token's
    character span once known: its starts and its ends (one attribute, set at once: another
    thread may read it meanwhile)."""

    __slots__ = ("text", "ids", "spans", "hashes")

    def __init__(self, text: str, ids: array, spans: tuple[array, array] | None, hashes):
        self.text, self.ids, self.spans, self.hashes = text, ids, spans, hashes


class Cut:
    """Where a text is cut: the ids before character `at` come from a recent text."""

    __slots__ = ("at", "ids", "starts", "ends")

    def __init__(self, at: int, ids, starts, ends):
        self.at, self.ids, self.starts, self.ends = at, ids, starts, ends


SPANS_MISSING = Cut(-1, None, None, None)  # a recent text shares a long prefix: its spans
NO_CUT = Cut(-1, None, None, None)  # ... known, and no cut allowed in the last _SEARCH tokens


class RecentPrompts:
    """The recent long texts encoded with one `add_special_tokens` setting (module
    docstring). `backend` is the Rust tokenizer; `rule` says where a cut may go (RULES).
    Safe to use from several threads."""

    def __init__(self, backend, add_special_tokens: bool, rule: str, min_chars: int = MIN_CHARS):
        self.backend, self.add, self.rule = backend, add_special_tokens, RULES[rule]
        self.min_chars, self.min_cut = min_chars, min(MIN_CUT, min_chars // 2)
        self.min_blocks = max(1, self.min_cut // BLOCK)
        added = backend.get_added_tokens_decoder().values()
        self.margin = max([CUT_MARGIN, *(len(t.content) + 2 for t in added)])
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # text -> entry, oldest first
        self._by_block: dict[int, _Entry] = {}  # a block hash -> the last used text with it
        self._chars = self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0  # texts encoded from a cut
        self.chars_reused = 0  # ... and the characters before their cuts
        self.tokens_reused = 0  # ... and the tokens before them (taken, not encoded)

    def cut(self, text: str, find_spans: bool = True) -> Cut | None:
        """The longest usable cut of `text` among the recent texts; None where none shares a
        long prefix with it; NO_CUT where one does but allows no cut; SPANS_MISSING when its
        token spans are not known yet and `find_spans` is False (finding them encodes it:
        work for a worker thread, not the event loop). The best text is the most recently
        used of those sharing the most whole blocks with `text` (block_hashes)."""
        if len(text) < self.min_chars:
            return None
        hashes = block_hashes(text)
        with self._lock:
            best = None
            for h in reversed(hashes[self.min_blocks - 1 :]):
                best = self._by_block.get(h)
                if best is not None:
                    break
            if best is None:
                return None
            self._touch(best)
        shared = common_prefix(text, best.text)  # (at least the blocks: hashes may collide)
        if best.spans is None:
            if not find_spans:
                return SPANS_MISSING
            self._find_spans(best)
        return self._cut_in(best, text, shared - self.margin) or NO_CUT

    def __len__(self) -> int:
        return len(self._entries)

    def reused(self, chars: int, tokens: int) -> None:
        """A text was encoded from a cut after `chars` characters and `tokens` tokens."""
        with self._lock:
            self.hits += 1
            self.chars_reused += chars
            self.tokens_reused += tokens

    def keep(self, text: str, ids: array, spans: tuple[array, array] | None = None) -> None:
        """Keep a long text's encoding (its tokens' starts and ends, if known)."""
        if len(text) < self.min_chars:
            return
        entry = _Entry(text, ids, spans, block_hashes(text))
        with self._lock:
            old = self._entries.pop(text, None)
            if old is not None:
                self._forget(old)
            self._entries[text] = entry
            self._chars += len(text)
            self._tokens += len(ids)
            self._touch(entry)
            while (
                len(self._entries) > KEPT or self._chars > KEPT_CHARS or self._tokens > KEPT_TOKENS
            ):
                self._forget(self._entries.popitem(last=False)[1])

    def _touch(self, entry: _Entry) -> None:
        """`entry` is the most recently used text: the last to go, and the one its blocks
        find (so a block finds nothing only once every text with it is gone)."""
        self._entries.move_to_end(entry.text)
        for h in entry.hashes:
            self._by_block[h] = entry

    def _forget(self, entry: _Entry) -> None:
        self._chars -= len(entry.text)
        self._tokens -= len(entry.ids)
        for h in entry.hashes:
            if self._by_block.get(h) is entry:
                del self._by_block[h]

    def _find_spans(self, entry: _Entry) -> None:
        encoding = self.backend.encode_batch([entry.text], add_special_tokens=self.add)[0]
        starts, ends = zip(*encoding.offsets) if encoding.offsets else ((), ())
        entry.spans = (array("i", starts), array("i", ends))  # (a thread that found them
        # missing meanwhile computes the same)

    def _cut_in(self, entry: _Entry, text: str, limit: int) -> Cut | None:
        """The last token of `entry` starting at or before `limit` where the rule allows a
        cut, within _SEARCH tokens; its ids and spans before it."""
        starts, ends = entry.spans
        last = bisect_right(starts, limit) - 1
        for i in range(last, max(0, last - _SEARCH), -1):
            at = starts[i]
            if at < self.min_cut:
                break  # (too short to pay)
            if ends[i - 1] > at:
                continue  # (inside the token before: byte pieces of one character)
            if self.rule(text, at):
                return Cut(at, entry.ids[:i], starts[:i], ends[:i])
        return None


def encode_with_cuts(
    backend,
    texts: list[str],
    add_special_tokens: bool,
    recent: RecentPrompts | None,
    cuts: list[Cut | None] | None = None,
) -> list[list[int]]:
    """Token ids of each non-empty text: cut where a recent text allows (the rest encoded
    with its spans, and the whole kept), else encoded whole without spans (kept with ids
    only, unless a recent text shares a long prefix with it and allowed no cut: that one
    stays the one found, its spans known). `cuts`: the texts' cuts if looked up already
    (none SPANS_MISSING)."""
    if cuts is None:
        cuts = [None if recent is None else recent.cut(t) for t in texts]
    usable = [c is not None and c.at >= 0 for c in cuts]
    whole = [t for t, u in zip(texts, usable) if not u]
    rests = [t[c.at :] for t, c, u in zip(texts, cuts, usable) if u]
    whole_ids = iter(
        [e.ids for e in backend.encode_batch_fast(whole, add_special_tokens=add_special_tokens)]
        if whole
        else []
    )
    rest_encodings = iter(backend.encode_batch(rests, add_special_tokens=False) if rests else [])
    out = []
    for text, cut, use in zip(texts, cuts, usable):
        if not use:
            ids = next(whole_ids)
            if cut is None and recent is not None and len(text) >= recent.min_chars:
                recent.keep(text, array("i", ids))
        else:
            rest = next(rest_encodings)
            recent.reused(cut.at, len(cut.ids))
            kept = cut.ids + array("i", rest.ids)
            ids = kept.tolist()
            at = cut.at
            starts = cut.starts + array("i", [at + s for s, _ in rest.offsets])
            ends = cut.ends + array("i", [at + e for _, e in rest.offsets])
            recent.keep(text, kept, (starts, ends))
        out.append(ids)
    return out


# What a cut might meet near it: runs of spaces and newlines, digits, punctuation,
# contractions, accents and combining marks, CJK, emoji, other spaces, the markers tokenizers
# use for a space, identifiers and URLs (and, added by `check`, the tokenizer's own tokens)
_PIECES = [
    "the", "The", "quick", "fox", "  ", "   ", "\n", "\n\n", " \n", "\r\n", "\t", "12", "345",
    "67890", "'s", "'ll", "don't", ".", ",", "!?", "...", "—", "(x)", "héllo", "e\u0301",
    "\u0301", "naïve", "你好", "世界", "🙂", "Ω", "ﬁ", "\u00a0", "\u2009", "\u3000", "▁", "Ġ",
    "__init__", "CamelCase", "http://x.y/z",
]  # fmt: skip


def _sample_texts(pieces: list[str], seed: int) -> list[str]:
    """Random texts of `pieces` sharing long prefixes: siblings after one prefix, and a text
    that goes on from another."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return "".join(rng.choice(pieces) + rng.choice(("", " ", " ", "  ")) for _ in range(n))

    texts = []
    for _ in range(12):
        prefix = words(rng.randrange(150, 300))
        first = prefix + words(rng.randrange(1, 30))
        texts += [first, prefix + words(rng.randrange(1, 30)), first + words(rng.randrange(1, 30))]
    return texts


def _every_cut_holds(backend, add_special_tokens: bool, rule, pieces: list[str]) -> bool:
    """Whether every cut `rule` allows in texts putting each piece before a space before
    each piece encodes as the whole does (and there are some)."""
    texts = ["".join(f"{left} {right} " for right in pieces) for left in pieces]
    cuts = 0
    for text, whole in zip(
        texts, backend.encode_batch(texts, add_special_tokens=add_special_tokens)
    ):
        starts, ends = [s for s, _ in whole.offsets], [e for _, e in whole.offsets]
        at = [
            i
            for i in range(1, len(starts))
            if 2 <= starts[i] < len(text) - 1 and ends[i - 1] <= starts[i] and rule(text, starts[i])
        ]
        rests = backend.encode_batch_fast([text[starts[i] :] for i in at], add_special_tokens=False)
        cuts += len(at)
        if any(whole.ids[:i] + rest.ids != whole.ids for i, rest in zip(at, rests)):
            return False
    return cuts > 0


def check(backend, add_special_tokens: bool, special: list[str]) -> str | None:
    """The cut rule (a RULES key) under which a text cut wherever the rule allows encodes as
    the whole does, over every piece of _PIECES and `special` before and after a space, and
    over random texts sharing prefixes (cuts made in most); None if neither rule does."""
    pieces = [*_PIECES, *special]
    texts = _sample_texts(pieces, seed=0)
    expected = [
        e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
    ]
    for name, rule in RULES.items():
        if not _every_cut_holds(backend, add_special_tokens, rule, pieces):
            continue
        recent = RecentPrompts(backend, add_special_tokens, name, min_chars=64)
        got = [encode_with_cuts(backend, [t], add_special_tokens, recent)[0] for t in texts]
        if got == expected and recent.hits >= len(texts) // 2:
            return name
    return None
