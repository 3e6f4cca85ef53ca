"""Tool calling on chat: which call format the model's chat template uses, the grammar that
forces a call (tool_choice required or a named function), and the calls parsed out of a
reply, whole or as it streams.

Two formats, told apart by the template's text:
- `hermes` (Qwen 2.5 and 3, Hermes, and templates like them): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, after any text.
- `llama3` (Llama 3.1 and later): the whole reply is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`.
A template that renders no tools gets no tools (the request is a 400 naming them).
"""

from __future__ import annotations

import json
import re
import uuid

from specserve.core.errors import InvalidRequestError
from specserve.core.sampling_params import Grammar
from specserve.model.loader import tools_template
from specserve.runtime.schema_checks import unsupported_schema_features

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def tool_format(template: str | dict | None) -> str | None:
    """The call format a tokenizer's chat template renders tools for (None: it renders
    none, or in a format not parsed here)."""
    template = tools_template(template)
    if template is None:
        return None
    if HERMES_OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or '"parameters"' in template:
        return "llama3"
    return None


def _arguments_key(fmt: str) -> str:
    return "arguments" if fmt == "hermes" else "parameters"


def call_grammar(tools: list[dict], fmt: str, name: str | None = None) -> Grammar:
    """The grammar of one call of one of `tools` (only `name`'s when given), in `fmt`."""
    key = _arguments_key(fmt)
    schemas = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        parameters = function.get("parameters") or {"type": "object"}
        missing = unsupported_schema_features(parameters)
        if missing:
            raise InvalidRequestError(
                f"the parameters of tool {function['name']!r} use what a forced call cannot "
                "enforce: " + ", ".join(missing),
                "tools",
            )
        schemas.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, key: parameters},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if fmt == "llama3":
        return Grammar("json_schema", json.dumps(schema), field="tool_choice")
    # (compiled off the event loop with every grammar: a schema can take seconds)
    return Grammar(
        "json_schema",
        json.dumps(schema),
        field="tool_choice",
        prefix=HERMES_OPEN + "\n",
        suffix="\n" + HERMES_CLOSE,
    )


def parse_calls(
    text: str, fmt: str, most: int | None = None
) -> tuple[str | None, list[dict], bool]:
    """(the reply's content, its tool calls as the API gives them, at most `most`, and
    whether every call's arguments were written to their end) from a whole reply, as a
    stream of it gives them (CallStream)."""
    stream = CallStream(fmt, most)
    stream.push(text)
    stream.finish()
    if not stream.calls:
        return text, [], True
    return (stream.content.rstrip() or None), stream.calls, stream.complete


# A call's start, its name before its arguments (as the templates ask and a forced call's
# grammar writes): what lets the name go out at once and the arguments as they are written.
_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:'
)
HEADER_MOST = 1024  # characters a call's start may take (past them: read as a whole call)
_LLAMA3_NEXT = re.compile(r"\s*\}\s*;\s*(?=\S)")  # llama3's calls: `{...}; {...}`


class _Value:
    """Where a JSON value written piece by piece ends: nesting and strings followed, nothing
    else checked (a malformed value goes out as written, as OpenAI's arguments may). With
    `stop` (Hermes' `</tool_call>`), that marker outside a string ends it too, unfinished
    (`cut`): a call with a brace missing does not take the calls after it."""

    def __init__(self, start: int, stop: str | None = None):
        self.start = start  # its first character (leading whitespace skipped)
        self.end = start  # scanned up to here (the value's end once complete)
        self.stop = stop
        self.kind = ""  # "", then "nest" ({ or [), "str" or "atom" (number, true, ...)
        self.depth = 0
        self.in_str = self.esc = False
        self.complete = False  # ended: written to its end, or cut by `stop`
        self.cut = False

    def scan(self, text: str) -> None:
        i, n, stop = self.end, len(text), self.stop
        while i < n and not self.complete:
            ch = text[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    self.complete = self.kind == "str"
            elif stop is not None and ch == stop[0]:
                if text.startswith(stop, i):
                    self.complete = self.cut = True
                    break
                if stop.startswith(text[i:]):
                    break  # (it may be the marker: wait for what follows)
                if self.kind == "atom":
                    break
                self.kind = self.kind or "atom"
            elif not self.kind:
                if ch.isspace():
                    self.start = i + 1
                else:
                    self.kind = "nest" if ch in "{[" else "str" if ch == '"' else "atom"
                    self.depth, self.in_str = (1, False) if ch in "{[" else (0, ch == '"')
                    if self.kind == "atom" and ch in ",}]":
                        break  # (nothing there)
            elif self.kind == "atom":
                if ch in ",}]" or ch.isspace():
                    break
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.complete = self.depth == 0
            i += 1
        self.end = i
        if self.kind == "atom" and i < n and not self.complete:
            if stop is None or not stop.startswith(text[i:]):
                self.complete = True


class CallStream:
    """One choice's reply, as it streams, split into content and tool calls: text that is,
    or may become, a call's start is held back; a call whose name comes first (as the
    templates and a forced call write it) goes out as soon as its name is written, its
    arguments as they are, as OpenAI streams them; any other call (arguments first) once
    its text ends, if it parses. A first call that is no call makes the whole reply content;
    a later one ends the calls (text after them is not content). A call cut short (the
    reply's end, or Hermes' `</tool_call>` before its arguments closed) keeps the arguments
    written, and `complete` says so (its finish_reason is then not "tool_calls")."""

    def __init__(self, fmt: str, most: int | None = None):
        self.fmt = fmt
        self.most = most  # calls kept (parallel_tool_calls false: 1)
        self.text = ""  # the whole reply so far
        self.sent = 0  # characters of it sent as content
        self.content = ""  # what was sent as content
        self.calls: list[dict] = []  # the calls so far, as the API gives them
        self.complete = True  # every call's arguments written to their end
        self._stop = HERMES_CLOSE if fmt == "hermes" else None
        self._body = 0  # where the open call's text starts (then: where to look on)
        self._whole: _Value | None = None  # the open call's text, read as a whole call
        self._value: _Value | None = None  # its arguments', once its name is out
        self._args_sent = 0
        self._seek = 0
        # "content" (no call yet), "call" (one open), "closing" (its arguments ended, its
        # close not yet written), "between" (calls), "text" (the reply is no call), "done"
        self._state = "content"

    def push(self, piece: str) -> tuple[str, list[dict]]:
        """Content to send now from the reply's next piece, and the calls' deltas (at most
        one a call: {"index", and "id", "type", "function": {"name", "arguments"}} when it
        starts, {"index", "function": {"arguments": more}} after)."""
        self.text += piece
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        """At the reply's end: content still to send, and the calls' last deltas."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[dict]]:
        deltas: dict[int, dict] = {}
        content = ""
        while True:
            state = self._state
            if state == "content":
                content += self._content(final)
            elif state == "call":
                self._call(final, deltas)
            elif state == "closing":
                self._close()
            elif state == "between":
                self._between()
            if self._state == "text":
                content += self._send(len(self.text) - self.sent)
            if self._state == state or self._state in ("text", "done"):
                break
        self.content += content
        return content, [deltas[i] for i in sorted(deltas)]

    def _content(self, final: bool) -> str:
        """Content up to a call's start (then state "call"); the rest at the reply's end."""
        rest = self.text[self.sent :]
        if self.fmt == "hermes":
            # (whitespace before a call is not content: held until text follows it)
            at = rest.find(HERMES_OPEN)
            if at >= 0:
                self._open(self.sent + at + len(HERMES_OPEN))
                return self._send(len(rest[:at].rstrip()))
            if final:
                return self._send(len(rest))
            return self._send(len(rest[: len(rest) - _partial(rest, HERMES_OPEN)].rstrip()))
        if self.sent == 0:  # llama3: a call is the whole reply
            head = self.text.lstrip()
            if head.startswith(PYTHON_TAG):
                self._open(self.text.index(PYTHON_TAG) + len(PYTHON_TAG))
                return ""
            if head.startswith("{"):
                self._open(0)
                return ""
            if not final and (not head or PYTHON_TAG.startswith(head)):
                return ""  # (nothing decided yet: hold)
        return self._send(len(rest))

    def _open(self, body: int) -> None:
        self._state, self._body, self._value, self._args_sent = "call", body, None, 0
        self._whole = _Value(body, self._stop)
        self._seek = body  # (where to look on for its `</tool_call>`)

    def _call(self, final: bool, deltas: dict[int, dict]) -> None:
        """The open call: its name out once written, its arguments as written; a call
        without that start decided when its text ends."""
        text, index = self.text, len(self.calls)
        if self._value is None:
            whole = self._whole
            before = whole.end
            whole.scan(text)  # (where its text ends, `</tool_call>` in strings aside)
            header = None
            if before - self._body < HEADER_MOST and ":" in text[before : whole.end + 1]:
                header = _HEADER.match(text, self._body, self._body + HEADER_MOST)
            name = _json_string(header.group(1)) if header else None
            if name is None:
                if whole.complete or final or whole.end - self._body >= HEADER_MOST:
                    self._call_whole(final, deltas)
                return
            call = {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            self.calls.append(call)
            deltas[index] = {"index": index, **call, "function": dict(call["function"])}
            self._value = _Value(header.end(), self._stop)
        index = len(self.calls) - 1
        value = self._value
        value.scan(text)
        more = text[value.start + self._args_sent : value.end] if value.kind else ""
        if more:
            self._args_sent += len(more)
            self.calls[index]["function"]["arguments"] += more
            delta = deltas.setdefault(index, {"index": index, "function": {"arguments": ""}})
            delta["function"]["arguments"] += more
        if value.complete:
            if value.cut:
                self.complete = False
            self._body = value.end
            self._close()
        elif final:
            self.complete = False  # (cut by the reply's end: the arguments written so far)
            self._state = "done"

    def _call_whole(self, final: bool, deltas: dict[int, dict]) -> None:
        """A call not written name first: taken once its text ends, if it parses."""
        whole = self._whole
        if self.fmt == "hermes":
            if not whole.complete and not final:
                return  # (its text ends at `</tool_call>`)
            end = whole.end if whole.cut else len(self.text)
            if not whole.cut:  # ended by its closing brace: its `</tool_call>` follows
                close = self.text.find(HERMES_CLOSE, max(whole.end, self._seek))
                if close < 0 and not final:
                    self._seek = len(self.text) - len(HERMES_CLOSE) + 1
                    return
                end = close if close >= 0 else len(self.text)
        elif not final:
            return
        else:
            end = len(self.text)
        call = _whole_call(self.text[self._body : end], self.fmt)
        if call is None:
            self._state = "done" if self.calls else "text"
            return
        index = len(self.calls)
        self.calls.append(call)
        deltas[index] = {"index": index, **call, "function": dict(call["function"])}
        if self.fmt == "hermes" and end < len(self.text):
            self._state, self._body = "between", end + len(HERMES_CLOSE)
        else:
            self._state = "done"

    def _close(self) -> None:
        """The open call's arguments have ended (at `_body`): then its close, and the next
        call."""
        if self.fmt != "hermes":  # llama3: `}`, then `;` and the next call, or the end
            if self.most is not None and len(self.calls) >= self.most:
                self._state = "done"
                return
            self._state = "closing"
            after = _LLAMA3_NEXT.match(self.text, self._body)
            if after is not None:
                self._open(after.end())
            return
        close = self.text.find(HERMES_CLOSE, self._body)
        if close >= 0:
            self._state, self._body = "between", close + len(HERMES_CLOSE)
        else:
            self._state = "closing"
            self._body = max(self._body, len(self.text) - len(HERMES_CLOSE) + 1)

    def _between(self) -> None:
        """After a call: the next one's start (text between calls is not content)."""
        if self.most is not None and len(self.calls) >= self.most:
            self._state = "done"
            return
        at = self.text.find(HERMES_OPEN, self._body)
        if at >= 0:
            self._open(at + len(HERMES_OPEN))
        else:
            self._body = max(self._body, len(self.text) - len(HERMES_OPEN) + 1)

    def _send(self, n: int) -> str:
        out = self.text[self.sent : self.sent + n]
        self.sent += n
        return out


def _json_string(quoted: str) -> str | None:
    """A JSON string's value; None where it does not parse or holds a lone surrogate
    (`"\\ud800"`, which no response could encode)."""
    try:
        value = json.loads(quoted)
        value.encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        return None
    return value


def _whole_call(body: str, fmt: str) -> dict | None:
    try:  # (strict=False: a control character inside a string, which an unconstrained
        # reply of tool_choice auto may hold, is kept, not a reason to miss the call)
        value = json.loads(body, strict=False)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    name = _json_string(json.dumps(value["name"]))
    if name is None:
        return None
    keys = ("arguments", "parameters") if fmt == "hermes" else ("parameters", "arguments")
    arguments = value.get(keys[0], value.get(keys[1], {}))
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        # (ASCII escapes: a lone surrogate in a string stays the escape the model wrote)
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of `text` begin `marker` (held back: it may follow)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
