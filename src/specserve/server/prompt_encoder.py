"""Prompt text to token ids in the HTTP process: exactly `tokenizer.encode`'s ids (so what
LLMEngine.tokenize gives offline), for less work, and off the event loop when long.

transformers encodes through the Rust tokenizer's `encode_batch`, which also works out every
token's character offsets; the server never reads them. Where transformers would run its
own encode path unchanged (no subclass overriding it, no truncation, padding or split
special tokens set), the ids come from `encode_batch_fast`: the same encoding without the
offsets (a 2,112-token prompt of the synthetic tokenizer in 1.0-1.2 ms instead of 1.6-1.8
on a 2-core CPU). Sample texts are encoded both ways when the encoder is built; any
difference and every prompt goes through `encode`.

Both release the GIL while they run, so a prompt longer than THREAD_CHARS is encoded on a
worker thread, in parallel with other requests' and with the event loop serving them (issue
31: requests of a closed-loop wave arrive together, and what the loop does for one, the
others wait for). Shorter ones are encoded on the loop: the hop to a thread costs the loop
about what encoding a thousand characters does (~50 us).

A long prompt that shares a long prefix with a recent one is encoded from a cut there
(server/prompt_prefixes.py): the cut is looked up on the loop (prompts up to LOOP_CHARS),
and a prompt whose rest is short is encoded there too.

A prompt far longer than any context is refused without encoding it (a 6 MB text took 12 s
of CPU and gigabytes of memory to encode, only to be refused): where the tokenizer keeps
every byte of its input in some token (`token_floor`), a text of B UTF-8 bytes has at
least B / L tokens, L being the most bytes any token spells (`fewest_tokens`).
"""

from __future__ import annotations

import asyncio
import json
import logging

from specserve.server import prompt_prefixes
from specserve.server.prompt_prefixes import SPANS_MISSING, RecentPrompts, encode_with_cuts

log = logging.getLogger("specserve.server")

THREAD_CHARS = 1024  # prompts (together) longer than this are encoded on a worker thread
LOOP_CHARS = 32768  # ... unless a cut leaves less, looked up on the loop up to this long (the
# lookup's own work grows with the text: ~0.2 ms of the loop at 20k characters)
# transformers' modules whose encode path ends in the Rust tokenizer's encode_batch
_GENERIC_MODULES = frozenset(
    {
        "transformers.tokenization_utils_base",
        "transformers.tokenization_utils_fast",  # transformers 4
        "transformers.tokenization_utils_tokenizers",  # transformers 5
    }
)
_ENCODE_PATH = (  # (__call__: apply_chat_template's tokenization)
    "__call__",
    "encode",
    "encode_plus",
    "_encode_plus",
    "_batch_encode_plus",
    "set_truncation_and_padding",
)
_SAMPLES = (
    "Hello world",
    "  leading, trailing and  double  spaces \n\n\tand tabs ",
    "Héllo wörld, naïve café — 你好 世界 🙂",
    "12 345 6789 0",
)


# Pre-tokenizers that keep every character of their input in some piece, and the Split
# behaviors that do (json: the pre-tokenizer's serialized form)
_KEEPING = {
    *("ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Sequence", "Split", "Punctuation"),
}
_KEEPING_SPLITS = {"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"}


def _keeps_everything(node) -> bool:
    if node is None:
        return True
    if node.get("type") not in _KEEPING:
        return False
    if node.get("behavior", "Isolated") not in _KEEPING_SPLITS:
        return False
    return all(_keeps_everything(child) for child in node.get("pretokenizers", ()))


def _has_byte_level(node) -> bool:
    if node is None:
        return False
    return node.get("type") == "ByteLevel" or any(
        _has_byte_level(child) for child in node.get("pretokenizers", ())
    )


class TokenFloor:
    """A lower bound on a text's tokens from its UTF-8 bytes (`of`): each token covers at
    most `per_token` bytes, and every byte but the `dropped` ones ends up in some token."""

    def __init__(self, per_token: int, dropped: bytes):
        self.per_token, self.dropped = per_token, dropped

    def of(self, text: str) -> int:
        data = text.encode("utf-8", "surrogatepass")
        if self.dropped:
            data = data.translate(None, self.dropped)
        return len(data) // self.per_token


def token_floor(backend) -> TokenFloor | None:
    """Where a text's token count has a lower bound from its size: a BPE model with no
    normalizer (which may drop or merge characters), pre-tokenizers that drop nothing, no
    added token that swallows the whitespace around it, and unknown characters kept
    (byte-level: the bytes whose symbols the model lacks are dropped and not counted;
    byte fallback with all 256 byte tokens; else an unknown token each, not fused). A
    token covers at most its string's UTF-8 bytes (a byte-level symbol one byte, `▁` one
    space, `<0x41>` one byte), and an unknown token one character (4 bytes at most).
    None: no such bound."""
    try:
        from tokenizers import models

        model = backend.model
        if not isinstance(model, models.BPE) or backend.normalizer is not None:
            return None
        pre = backend.pre_tokenizer
        pre_json = None if pre is None else json.loads(pre.__getstate__())
        if not _keeps_everything(pre_json):
            return None
        if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
            return None
        own = backend.get_vocab(False)  # (the model's: added tokens match whole texts)
        dropped = b""
        if _has_byte_level(pre_json):
            dropped = bytes(b for b, symbol in enumerate(_BYTE_SYMBOLS) if symbol not in own)
        elif model.byte_fallback and all(f"<0x{b:02X}>" in own for b in range(256)):
            pass
        elif not (model.unk_token and not model.fuse_unk):
            return None  # (unknown characters would be dropped or fused into one token)
        longest = max(len(piece.encode("utf-8")) for piece in backend.get_vocab(True))
        return TokenFloor(max(longest, 4), dropped)
    except Exception:  # (a tokenizer unlike these: no bound)
        return None


def _byte_symbols() -> list[str]:
    """The byte-level alphabet's symbol of each byte (GPT-2's mapping: printable bytes as
    themselves, the others in order from U+0100)."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


_BYTE_SYMBOLS = _byte_symbols()


def _fast_backend(tokenizer):
    """The Rust tokenizer when its encode_batch_fast gives exactly tokenizer.encode's ids;
    else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    for name in _ENCODE_PATH:
        method = getattr(type(tokenizer), name, None)
        if method is not None and getattr(method, "__module__", None) not in _GENERIC_MODULES:
            return None  # a subclass with its own encoding (code_llama's infilling, ...)
    if getattr(tokenizer, "split_special_tokens", False):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None  # (transformers resets them on every encode)
    special = [getattr(tokenizer, name, None) for name in ("bos_token", "eos_token")]
    special = [t for t in special if isinstance(t, str)]
    samples = [*_SAMPLES, "".join(special) + " Hello " + " ".join(special)]
    for add in (True, False):
        fast = [e.ids for e in backend.encode_batch_fast(samples, add_special_tokens=add)]
        if fast != [tokenizer.encode(s, add_special_tokens=add) for s in samples]:
            log.warning("the tokenizer's encode_batch_fast differs from encode: not used")
            return None
    return backend


class PromptEncoder:
    """Token ids of prompt texts, exactly as `tokenizer.encode(text, add_special_tokens=...)`
    gives them (see the module)."""

    def __init__(self, tokenizer, prefix_min_chars: int = prompt_prefixes.MIN_CHARS):
        self.tokenizer = tokenizer
        self._backend = None if tokenizer is None else _fast_backend(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._floor = None if backend is None else token_floor(backend)
        # add_special_tokens -> the recent long prompts (server/prompt_prefixes.py), or None
        # where the tokenizer's cut encodings differ from its whole ones
        self.recent: dict[bool, RecentPrompts | None] = {True: None, False: None}
        if self._backend is not None:
            special = list(tokenizer.all_special_tokens)
            special += [t.content for t in tokenizer.added_tokens_decoder.values()][:16]
            for add in (True, False):
                rule = prompt_prefixes.check(self._backend, add, sorted(set(special)))
                if rule is not None:
                    self.recent[add] = RecentPrompts(self._backend, add, rule, prefix_min_chars)
            if None in self.recent.values():
                log.info(
                    "long prompts sharing a prefix are encoded whole (add_special_tokens: %s)",
                    [add for add, recent in self.recent.items() if recent is None],
                )

    def stats(self) -> dict[str, int]:
        """What the recent prompts saved (for /metrics): prompts encoded from a cut, the
        tokens taken from the recent prompts' ids instead of encoded, the prompts kept."""
        recent = [r for r in self.recent.values() if r is not None]
        return {
            "prompts_from_cut": sum(r.hits for r in recent),
            "tokens_reused": sum(r.tokens_reused for r in recent),
            "prompts_kept": sum(len(r) for r in recent),
        }

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to (0 where the tokenizer gives none:
        see the module), in time linear in the text and far below encoding it."""
        floor = self._floor
        if floor is None or len(text) * 4 < floor.per_token:
            return 0
        return floor.of(text)

    @property
    def fast(self) -> bool:
        """Whether prompts skip transformers for the Rust tokenizer's encode_batch_fast."""
        return self._backend is not None

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text (an empty text has none), on the calling thread."""
        return self._encode(texts, add_special_tokens, None)

    def _encode(self, texts: list[str], add: bool, cuts: list | None) -> list[list[int]]:
        if self._backend is None:
            return [self.tokenizer.encode(t, add_special_tokens=add) if t else [] for t in texts]
        present = [t for t in texts if t]
        encoded = iter(encode_with_cuts(self._backend, present, add, self.recent[add], cuts))
        return [next(encoded) if t else [] for t in texts]

    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """encode_many, on a worker thread when what is left to encode is long (THREAD_CHARS):
        the texts, less what their cuts among the recent prompts take from them (looked up
        here, on the loop, for texts up to LOOP_CHARS long)."""
        recent = self.recent[add_special_tokens] if self._backend is not None else None
        cuts = None
        left = sum(len(t) for t in texts)
        if recent is not None and THREAD_CHARS < left <= LOOP_CHARS:
            cuts = [recent.cut(t, find_spans=False) for t in texts if t]
            if SPANS_MISSING in cuts:
                cuts = None  # (the thread looks them up again, and finds the spans)
            else:
                left -= sum(c.at for c in cuts if c is not None and c.at > 0)
        if left > THREAD_CHARS:
            return await asyncio.to_thread(self._encode, texts, add_special_tokens, cuts)
        return self._encode(texts, add_special_tokens, cuts)
