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
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


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


def parse_calls(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """(the reply's content, its tool calls as the API gives them) from a whole reply; a
    call whose JSON does not parse, or lacks a name, leaves the reply as content."""
    if fmt == "hermes":
        start = text.find(HERMES_OPEN)
        if start < 0:
            return text, []
        calls = []
        for body in _HERMES_CALL.findall(text[start:]):
            call = _call(body, "arguments")
            if call is None:
                return text, []
            calls.append(call)
        content = text[:start].rstrip()  # (as streamed: CallStream holds trailing space)
        return (content or None), calls
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :]
    call = _call(body, "parameters") if body.lstrip().startswith("{") else None
    return (text, []) if call is None else (None, [call])


def _call(body: str, key: str) -> dict | None:
    try:  # (strict=False: a control character inside a string, which an unconstrained
        # reply of tool_choice auto may hold, is kept, not a reason to miss the call)
        value = json.loads(body, strict=False)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(key, value.get("arguments", {}))
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": value["name"], "arguments": json.dumps(arguments)},
    }


class CallStream:
    """One streamed choice's text split into content to send now and a possible call held
    back: text that is, or may become, a call's start is held until the reply ends."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.text = ""  # the whole reply so far
        self.sent = 0  # characters of it sent as content
        self.in_call = False

    def push(self, piece: str) -> str:
        """Content to send now from the reply's next piece."""
        self.text += piece
        if self.in_call:
            return ""
        rest = self.text[self.sent :]
        if self.fmt == "hermes":
            # (whitespace before a call is not content: held until text follows it)
            at = rest.find(HERMES_OPEN)
            if at >= 0:
                self.in_call = True
                return self._send(len(rest[:at].rstrip()))
            return self._send(len(rest[: len(rest) - _partial(rest, HERMES_OPEN)].rstrip()))
        if self.sent == 0:  # llama3: a call is the whole reply
            head = self.text.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self.in_call = True
                return ""
            if not head or PYTHON_TAG.startswith(head):
                return ""  # (nothing decided yet: hold)
        return self._send(len(rest))

    def _send(self, n: int) -> str:
        out = self.text[self.sent : self.sent + n]
        self.sent += n
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """At the reply's end: content still to send, and the calls (none: it was text)."""
        content, calls = parse_calls(self.text, self.fmt)
        if not calls:
            return self.text[self.sent :], []
        return "", calls  # (the content before the calls went out already)


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of `text` begin `marker` (held back: it may follow)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
