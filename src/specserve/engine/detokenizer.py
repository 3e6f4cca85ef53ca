"""Incremental detokenization that is exact for multi-byte characters, with stop strings."""

from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces come out right


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Text is only released once the decoded tail is no longer an incomplete UTF-8 sequence.
    A stop string truncates the text before it; until the request ends, the last
    (longest stop - 1) characters are held back from `pop_delta` so a stop string split
    across tokens is never streamed.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> None:
        if self.stopped:
            return
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.holdback)
        self.text += new
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def pop_delta(self, finished: bool) -> str:
        end = len(self.text) if finished or self.stopped else len(self.text) - self.holdback
        end = max(end, self.emitted)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
