"""OpenAI response shapes built from engine output deltas: completions and chat
completions, whole or as stream chunks, with logprobs and usage.

Chunks are plain dicts (pydantic costs too much per token at hundreds of streams); their
shapes are documented by the models in server/protocol.py, and tests check them against
those models and the official client.
"""

from __future__ import annotations

import codecs
import json
import re
import time

from specserve.server.messages import OutputDelta
from specserve.server.tools import CallStream, parse_calls

_MIN_LOGPROB = -9999.0  # JSON has no -inf
SIMULATED_FINGERPRINT = "specserve-SIMULATED-ACCEPTANCE-outputs-are-not-the-model's"


def _lp(x: float) -> float:
    return x if x > _MIN_LOGPROB else _MIN_LOGPROB


def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet: printable stand-in character -> byte."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """Display string and exact UTF-8 bytes of single tokens, cached (used for logprobs).
    A token that is only part of a UTF-8 character displays as "bytes:\\xNN..." (as OpenAI
    does), so distinct partial tokens never collide in top_logprobs dicts. A token's text
    keeps its leading space: decoding a lone token drops it in SentencePiece vocabularies
    (their decoders strip the text's first space), so their tokens are read from the
    vocabulary itself ("▁" a space, "<0xNN>" a byte), as GPT-2-style byte-level ones are."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        kind = _vocabulary_kind(tokenizer)
        self._byte_decoder = _byte_decoder() if kind == "byte_level" else None
        self._sentencepiece = kind == "sentencepiece"
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())

    def is_special(self, token_id: int) -> bool:
        """A special token (EOS, BOS...): generated text leaves it out."""
        return token_id in self._special

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._read(token_id)
        return hit

    def _read(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        raw = text.encode()
        if token_id not in self._special and (self._byte_decoder or self._sentencepiece):
            piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
            if self._byte_decoder is not None:
                if piece and all(c in self._byte_decoder for c in piece):
                    raw = bytes(self._byte_decoder[c] for c in piece)
            elif _BYTE_PIECE.fullmatch(piece):  # (SentencePiece's byte fallback)
                raw = bytes([int(piece[3:5], 16)])
            elif piece:
                raw = piece.replace(SENTENCEPIECE_SPACE, " ").encode()
        try:
            text = raw.decode()
        except UnicodeDecodeError:  # part of a character: show its bytes, like OpenAI
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, list(raw)


class TextOffsets:
    """Where each token starts in a text (completions' text_offset): after the characters
    of the tokens before it, their bytes decoded as they come (a character split across
    tokens counts at the token that completes it), special tokens counting none where the
    text leaves them out. Not the text sent so far, which lags the tokens (a stop string's
    candidates and an unfinished character are held back)."""

    __slots__ = ("chars", "_decoder", "_text", "_specials")

    def __init__(self, text: TokenText, start: int = 0, specials: bool = False):
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text, self._specials = text, specials

    def advance(self, token_id: int) -> int:
        """The token's offset; the next one's follows it."""
        at = self.chars
        if self._specials or not self._text.is_special(token_id):
            self.chars += len(self._decoder.decode(bytes(self._text.get(token_id)[1])))
        return at


SENTENCEPIECE_SPACE = "\u2581"  # "▁": a space in SentencePiece vocabularies
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _vocabulary_kind(tokenizer) -> str | None:
    """ "byte_level" (GPT-2's byte alphabet), "sentencepiece" (▁ for spaces, <0xNN> byte
    fallback) or None, from the fast tokenizer's decoder."""
    try:
        decoder = json.dumps(json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder"))
    except Exception:
        return None
    if "ByteLevel" in decoder:
        return "byte_level"
    if "Metaspace" in decoder or "ByteFallback" in decoder or "\\u2581" in decoder:
        return "sentencepiece"
    return None


class _Choice:
    """Accumulated state of one choice."""

    __slots__ = (
        "text",
        "num_tokens",
        "finish_reason",
        "logprobs",
        "offsets",
        "cached_tokens",
        "echoed",
    )

    def __init__(self) -> None:
        self.text: list[str] = []
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.logprobs: list = []  # completions: the four parallel lists; chat: entries
        self.offsets: TextOffsets | None = None  # completions' text_offset of its next token
        self.cached_tokens = 0  # its prompt tokens the prefix cache had
        self.echoed = False  # its prompt went out ahead of its text (completions' echo)


class _Formatter:
    """Shared bookkeeping: choices, usage, ids."""

    object_name = ""
    chunk_object = ""

    def __init__(self, request_id, model, num_choices, num_prompt_tokens, logprobs, text):
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(num_choices)]
        self.num_prompt_tokens = num_prompt_tokens
        # Choice i of prompt p is choices[p * per_prompt + i]: a prompt's cached tokens
        # count once, as its prompt tokens do.
        self.per_prompt = 1
        self.logprobs = logprobs  # None: no logprobs
        self.token_text: TokenText = text

    def usage(self) -> dict:
        completion = sum(c.num_tokens for c in self.choices)
        cached = sum(c.cached_tokens for c in self.choices[:: self.per_prompt])
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _absorb(self, index: int, delta: OutputDelta) -> _Choice:
        c = self.choices[index]
        c.text.append(delta.delta_text)
        c.num_tokens += len(delta.new_token_ids)
        if delta.finished:
            c.finish_reason = delta.finish_reason
            c.cached_tokens = delta.num_cached_tokens or 0
        return c

    simulated = False  # set when the engine simulates acceptance: every response says so

    def _envelope(self, obj: str, choices: list, usage_field: bool) -> dict:
        out = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.simulated:
            out["system_fingerprint"] = SIMULATED_FINGERPRINT
        if usage_field:
            out["usage"] = None
        return out

    def usage_chunk(self) -> dict:
        out = self._envelope(self.chunk_object, [], False)
        out["usage"] = self.usage()
        return out


class CompletionFormatter(_Formatter):
    """/v1/completions: choice text plus legacy logprobs (tokens, token_logprobs,
    top_logprobs, text_offset)."""

    chunk_object = "text_completion"
    # per prompt, with echo: (text, ids, each token's offset in the text or None)
    echo: list[tuple[str, list[int], list[int] | None]] | None = None
    score_only = False  # max_tokens 0 with echo: the prompt and its logprobs, nothing more

    def _take(self, index: int, delta: OutputDelta) -> tuple[str, dict | None]:
        """A delta's text and logprobs part, after the prompt when this is the choice's
        first (echo), absorbed into the choice."""
        c = self.choices[index]
        head, head_lp = "", None
        if self.echo is not None and not c.echoed:
            c.echoed = True
            head, ids, offsets = self.echo[index // self.per_prompt]
            if self.logprobs is not None:
                head_lp = self._prompt_part(ids, delta.prompt_logprobs, offsets)
            c.text.append(head)
            c.offsets = TextOffsets(self.token_text, len(head))
        if self.score_only:  # (the one token drawn is not part of the answer)
            delta = OutputDelta(
                delta.request_id,
                "",
                [],
                None,
                delta.finished,
                "length",
                delta.spec_stats,
                delta.num_cached_tokens,
            )
        lp = self._logprobs(c, delta)
        self._absorb(index, delta)
        if head_lp is not None and lp is not None:
            lp = {k: head_lp[k] + lp[k] for k in head_lp}
        return head + delta.delta_text, lp if lp is not None else head_lp

    def _prompt_part(self, ids: list[int], rated: list | None, offsets: list[int] | None) -> dict:
        """The prompt's tokens as legacy logprobs: the first rated by nothing (None); their
        offsets in the echoed text as given, else counted (its special tokens as text)."""
        rated = rated or [None] * len(ids)
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if offsets is None:
            counter = TextOffsets(self.token_text, specials=True)
            offsets = [counter.advance(tid) for tid in ids]
        for tid, entry, offset in zip(ids, rated, offsets):
            text = self.token_text.get(tid)[0]
            part["tokens"].append(text)
            part["text_offset"].append(offset)
            if entry is None:
                part["token_logprobs"].append(None)
                part["top_logprobs"].append(None)
                continue
            lp, top = entry
            tops = {self.token_text.get(t)[0]: _lp(v) for t, v in top}
            tops.setdefault(text, _lp(lp))
            part["token_logprobs"].append(_lp(lp))
            part["top_logprobs"].append(tops)
        return part

    def _logprobs(self, c: _Choice, delta: OutputDelta) -> dict | None:
        if self.logprobs is None or delta.new_logprobs is None:
            return None
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if c.offsets is None:
            c.offsets = TextOffsets(self.token_text)
        advance = c.offsets.advance
        for tid, (lp, top) in zip(delta.new_token_ids, delta.new_logprobs):
            text = self.token_text.get(tid)[0]
            tops = {self.token_text.get(t)[0]: _lp(v) for t, v in top}
            tops.setdefault(text, _lp(lp))
            part["tokens"].append(text)
            part["token_logprobs"].append(_lp(lp))
            part["top_logprobs"].append(tops)
            part["text_offset"].append(advance(tid))
        return part

    def chunks(self, index: int, delta: OutputDelta, usage_field: bool) -> list[dict]:
        """The events of a choice's next delta (none or one)."""
        text, lp = self._take(index, delta)
        if not text and lp is None and not delta.finished:
            return []
        choice = {
            "index": index,
            "text": text,
            "logprobs": lp,
            "finish_reason": self.choices[index].finish_reason if delta.finished else None,
        }
        return [self._envelope(self.chunk_object, [choice], usage_field)]

    def add(self, index: int, delta: OutputDelta) -> None:
        _, lp = self._take(index, delta)
        if lp is not None:
            self.choices[index].logprobs.append(lp)

    def response(self) -> dict:
        choices = []
        for i, c in enumerate(self.choices):
            lp = None
            if self.logprobs is not None:
                lp = {
                    k: [x for part in c.logprobs for x in part[k]]
                    for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
                }
            choices.append(
                {
                    "index": i,
                    "text": "".join(c.text),
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                }
            )
        out = self._envelope("text_completion", choices, False)
        out["usage"] = self.usage()
        return out


class ChatFormatter(_Formatter):
    """/v1/chat/completions: assistant message (or deltas) plus chat logprobs."""

    chunk_object = "chat.completion.chunk"

    def _entries(self, delta: OutputDelta) -> list | None:
        if self.logprobs is None or delta.new_logprobs is None:
            return None
        out = []
        for tid, (lp, top) in zip(delta.new_token_ids, delta.new_logprobs):
            text, raw = self.token_text.get(tid)
            tops = []
            for t, v in top:
                ttext, traw = self.token_text.get(t)
                tops.append({"token": ttext, "logprob": _lp(v), "bytes": traw})
            out.append({"token": text, "logprob": _lp(lp), "bytes": raw, "top_logprobs": tops})
        return out

    def role_chunks(self, usage_field: bool) -> list[dict]:
        # (a reply that must be a call has no content: null, as OpenAI sends it)
        content = None if self.forced_call else ""
        return [
            self._envelope(
                self.chunk_object,
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": content},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                usage_field,
            )
            for i in range(len(self.choices))
        ]

    tools_format: str | None = None  # with tools offered: their call format (server/tools.py)
    most_calls: int | None = None  # parallel_tool_calls false: a reply's first call only
    forced_call = False  # tool_choice required or a named function: the reply is a call

    def __init__(self, *args):
        super().__init__(*args)
        self._calls: dict[int, CallStream] = {}  # streamed choices' held-back calls

    def chunks(self, index: int, delta: OutputDelta, usage_field: bool) -> list[dict]:
        """The events of a choice's next delta: none, its content (with its logprobs), its
        tool calls' deltas (a call's name once written, its arguments as written), and
        where the reply has calls, its end as an empty delta with the finish reason after
        them (OpenAI's order, which the openai client's stream helper needs to say a
        call's arguments are done)."""
        self._absorb(index, delta)
        entries = self._entries(delta)
        text, calls = delta.delta_text, []
        finish = delta.finish_reason if delta.finished else None
        made_calls = False
        if self.tools_format is not None:
            stream = self._calls.get(index)
            if stream is None:
                stream = self._calls[index] = CallStream(self.tools_format, self.most_calls)
            text, calls = stream.push(text)
            if delta.finished:
                rest, more = stream.finish()
                text += rest
                calls = _merge_deltas(calls, more)
                finish = _call_finish(finish, stream.calls, stream.complete)
            made_calls = bool(stream.calls)
        if not text and not calls and entries is None and not delta.finished:
            return []
        logprobs = None if entries is None else {"content": entries, "refusal": None}
        if not calls and not (delta.finished and made_calls):
            message = {"content": text} if text else {}
            return [self._choice_chunk(index, message, logprobs, finish, usage_field)]
        out = []
        if text or logprobs is not None:
            message = {"content": text} if text else {}
            out.append(self._choice_chunk(index, message, logprobs, None, usage_field))
        if calls:
            out.append(self._choice_chunk(index, {"tool_calls": calls}, None, None, usage_field))
        if delta.finished:
            out.append(self._choice_chunk(index, {}, None, finish, usage_field))
        return out

    def _choice_chunk(self, index, message, logprobs, finish, usage_field) -> dict:
        choice = {"index": index, "delta": message, "logprobs": logprobs, "finish_reason": finish}
        return self._envelope(self.chunk_object, [choice], usage_field)

    def add(self, index: int, delta: OutputDelta) -> None:
        c = self._absorb(index, delta)
        entries = self._entries(delta)
        if entries is not None:
            c.logprobs.extend(entries)

    def response(self) -> dict:
        choices = []
        for i, c in enumerate(self.choices):
            message = {"role": "assistant", "content": "".join(c.text)}
            finish = c.finish_reason
            if self.tools_format is not None:
                content, calls, complete = parse_calls(
                    message["content"], self.tools_format, self.most_calls
                )
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish = _call_finish(finish, calls, complete)
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": None
                    if self.logprobs is None
                    else {"content": c.logprobs, "refusal": None},
                    "finish_reason": finish,
                }
            )
        out = self._envelope("chat.completion", choices, False)
        out["usage"] = self.usage()
        return out


def _merge_deltas(first: list[dict], then: list[dict]) -> list[dict]:
    """Two lists of calls' deltas as one, a call's arguments joined (one delta a call)."""
    merged = {d["index"]: d for d in first}
    for d in then:
        if d["index"] in merged:
            merged[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
        else:
            merged[d["index"]] = d
    return [merged[i] for i in sorted(merged)]


def _call_finish(finish: str | None, calls: list[dict], complete: bool) -> str | None:
    """A reply's finish reason with tool calls in it: "tool_calls" when the model ended it
    with every call written to its end; else as it ended: "length" when max_tokens or the
    context cut it (a call after the last one may be cut off: the client must know), "stop"
    when a call was left unfinished (its arguments then do not parse)."""
    return "tool_calls" if calls and finish == "stop" and complete else finish


# Line separators JSON allows raw but line-splitting clients (Python's str.splitlines, so
# httpx's aiter_lines) break events at: sent as \u escapes, the same text once decoded.
_SSE_ESCAPES = (("\u2028", "\\u2028"), ("\u2029", "\\u2029"), ("\u0085", "\\u0085"))


def sse(obj: dict) -> bytes:
    """One server-sent event carrying a JSON object, on one line for any line splitter.
    (ASCII text has none of the separators: `isascii` is a flag, and `replace` only runs
    where one is found; a `str.translate` table of them costs ~0.1 us a character.)"""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    if not text.isascii():
        for sep, escaped in _SSE_ESCAPES:
            if sep in text:
                text = text.replace(sep, escaped)
    return b"data: " + text.encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
