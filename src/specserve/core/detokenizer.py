"""Incremental detokenization that is exact for multi-byte characters, with stop strings.

Each new token extends a window of ids (starting with a few prompt tokens, for leading
spaces); the text the window decodes to past the previous window's text is released once it
no longer ends in an incomplete character, and the window then restarts at the released
tokens. For byte-level tokenizers the released text is exactly `tokenizer.decode` of the
whole output. Decoding is most of a step's host work per request, so when `tokenizer.decode`
gives what its `tokenizers` backend gives (no transformers clean-up), the backend's
`DecodeStream` keeps the window (one native call per token, same rule); otherwise the window
is decoded through the backend or, for any other tokenizer, through `tokenizer.decode`.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces come out right
# Text that the transformers clean-up (`clean_up_tokenization_spaces`) would change.
_CLEAN_UP_PROBE = "a . b , c ! d ? e n't f 'm g 's h 've i 're j"


class TokenDecoder:
    """Ids to text for one tokenizer (skipping special tokens), shared by its requests.

    `backend` is the `tokenizers.Tokenizer` when decoding through it gives exactly what
    `tokenizer.decode` gives (else None); `streams` says whether its DecodeStream can start
    from a window of context ids.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = _exact_backend(tokenizer)
        self._stream_class = _stream_class() if self.backend is not None else None
        self.streams = self._stream_class is not None

    def decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stream(self, context: list[int]):
        """A native incremental decoder whose window starts as `context`, or None. (A
        context ending inside a character would start the stream with an empty text, which
        would then count the context's last characters as output.)"""
        if self._stream_class is None or self.decode(context).endswith("\ufffd"):
            return None
        return self._stream_class(ids=list(context), skip_special_tokens=True)


def _stream_class():
    """tokenizers' DecodeStream when it takes a starting window (`ids`), else None."""
    try:
        from tokenizers.decoders import DecodeStream

        DecodeStream(ids=[], skip_special_tokens=True)
    except (ImportError, TypeError):
        return None
    return DecodeStream


def _exact_backend(tokenizer):
    """The tokenizers.Tokenizer behind a transformers fast tokenizer whose decode adds
    nothing to the backend's (the library's own decode, clean-up off or skipped), or None."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    for name in ("decode", "_decode"):
        owner = next((c for c in type(tokenizer).__mro__ if name in vars(c)), None)
        if owner is None or not owner.__module__.startswith("transformers.tokenization_utils"):
            return None  # a tokenizer class with its own decoding
    try:
        probe = tokenizer.encode(_CLEAN_UP_PROBE, add_special_tokens=False)
        if tokenizer.decode(probe, skip_special_tokens=True) != backend.decode(
            probe, skip_special_tokens=True
        ):
            return None
    except Exception:  # an unusual tokenizer: keep its own decode
        return None
    return backend


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Text is only released once the decoded tail is no longer an incomplete UTF-8 sequence,
    or the output ends (`finish`: what decode makes of it, U+FFFD).
    A stop string truncates the text before it; until the request ends, the last
    (longest stop - 1) characters are held back from `pop_delta` so a stop string split
    across tokens is never streamed.
    """

    def __init__(
        self,
        tokenizer,
        prompt_ids: list[int],
        stop: list[str],
        decoder: TokenDecoder | None = None,
        min_tokens: int = 0,
    ):
        self.decoder = decoder if decoder is not None else TokenDecoder(tokenizer)
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        # The window: ids[prefix_offset:read_offset] decode to text already released.
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._stream = self.decoder.stream(self.ids)
        self._backend = self.decoder.backend
        self.stop = stop
        # stop strings end the text only from this many tokens on (min_tokens, as vLLM)
        self.min_tokens, self.pushed = min_tokens, 0
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, token: int) -> None:
        if self.stopped:
            return
        self.pushed += 1
        ids = self.ids
        ids.append(token)
        if self._stream is not None:
            try:
                new = self._stream.step(self._backend, token)
            except Exception:
                # The stream refuses a window whose text does not extend the previous
                # window's (invalid bytes under byte fallback); the decode path slices it
                # by characters, as it always has.
                self._stream = None
                new = self._step_by_decode()
            else:
                if new is None:
                    return
                self.prefix_offset = self.read_offset
                self.read_offset = len(ids)
        else:
            new = self._step_by_decode()
        if new is None:
            return
        if self.stop and self.pushed >= self.min_tokens:
            self._add_text_and_stop(new)
        else:
            self.text += new

    def _step_by_decode(self) -> str | None:
        ids, decode = self.ids, self.decoder.decode
        prefix = decode(ids[self.prefix_offset : self.read_offset])
        full = decode(ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return None
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        if self._backend is not None:  # released up to here: the stream can take over again
            self._stream = self.decoder.stream(ids[self.prefix_offset :])
        return full[len(prefix) :]

    def _add_text_and_stop(self, new: str) -> None:
        start = max(0, len(self.text) - self.holdback)  # a stop string may begin this far back
        text = self.text = self.text + new
        cut = -1
        for stop in self.stop:
            i = text.find(stop, start)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            self.text = text[:cut]
            self.stopped = True

    def finish(self) -> None:
        """The output ends: tokens held back as an incomplete character are released as
        what `tokenizer.decode` makes of them (U+FFFD for an invalid or cut sequence), as
        the logprobs' bytes say (for byte-level tokenizers the text is then the decode of
        every token; byte fallback's decode may also replace valid bytes before them)."""
        if self.stopped or self.read_offset == len(self.ids):
            return
        ids, decode = self.ids, self.decoder.decode
        prefix = decode(ids[self.prefix_offset : self.read_offset])
        full = decode(ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(ids)
        self._stream = None
        if len(full) > len(prefix):
            new = full[len(prefix) :]
            if self.stop and self.pushed >= self.min_tokens:
                self._add_text_and_stop(new)
            else:
                self.text += new

    def pop_delta(self, finished: bool) -> str:
        """The text released since the last call (all of it once `finished`)."""
        if finished:
            self.finish()
        text = self.text
        end = len(text) if finished or self.stopped else len(text) - self.holdback
        if end <= self.emitted:
            return ""
        delta = text[self.emitted : end]
        self.emitted = end
        return delta
