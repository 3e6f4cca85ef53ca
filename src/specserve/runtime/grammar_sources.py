"""A grammar's source as xgrammar takes it: a JSON schema checked for what its grammar would
not enforce (refused by name) and its length-bounded strings rewritten as JSON strings, text
as an EBNF literal, and xgrammar's errors without their log prefix. (The compiled grammars,
matchers and each step's masks: runtime/grammar.py.)"""

from __future__ import annotations

import json
import re

import xgrammar as xgr

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: "


# xgrammar (0.2.9) writes a string with minLength or maxLength as that many of
# `X_characters ::= (([^\"\\\r\n]))`: control characters, which JSON forbids unescaped
# in strings, pass (sampled replies failed json.loads), and no escape does. Such rules are
# rewritten as JSON's string characters: any but the control ones, '"' and '\', or an escape.
_BOUNDED_CHARACTERS = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_CHARACTER = r'\1 ::= (([^\\0-\\x1f\\"\\\\]) | ("\\\\" specserve_json_escape))'
_JSON_ESCAPE = (
    'specserve_json_escape ::= (([\\"\\\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] '
    "[A-Fa-f0-9]))"
)


def schema_grammar(source: str) -> xgr.Grammar:
    """A JSON schema's grammar (no whitespace beyond what JSON needs), its length-bounded
    strings made of JSON's string characters (`_BOUNDED_CHARACTERS`)."""
    grammar = xgr.Grammar.from_json_schema(source, any_whitespace=False)
    text, bounded = _BOUNDED_CHARACTERS.subn(_JSON_CHARACTER, str(grammar))
    if not bounded:
        return grammar
    return xgr.Grammar.from_ebnf(f"{text}\n{_JSON_ESCAPE}\n", root_rule_name="root")


def ebnf_text(text: str) -> str:
    """`text` as an EBNF string literal (characters past U+FFFF as themselves: a JSON
    escape would write them as two surrogates, which match nothing)."""
    return json.dumps(text, ensure_ascii=False)


def compile_error(e: Exception) -> str:
    """What xgrammar's error says, without its log prefix (time, C++ source file and line)."""
    reason = str(e).split("Check failed:")[-1].strip()
    return _LOG_PREFIX.sub("", reason)


# JSON schema keywords xgrammar compiles but does not enforce (measured: it accepts an
# instance that violates them): refused by name rather than silently ignored. `oneOf` is
# enforced as anyOf (pydantic's unions produce it; their alternatives rarely overlap).
UNENFORCED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "allOf",
        "uniqueItems",
        "contains",
        "dependentRequired",
        "dependentSchemas",
        "minContains",
        "maxContains",
    }
)
FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)


def unsupported_schema_features(schema) -> list[str]:
    """What a JSON schema asks for that its grammar would not enforce: keywords, formats,
    references outside the schema (each named once, in the order found)."""
    found: list[str] = []

    def note(what: str) -> None:
        if what not in found:
            found.append(what)

    def walk(node, in_properties=False) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            if in_properties:  # property names, not keywords
                walk(value)
                continue
            if key in UNENFORCED_KEYWORDS:
                note(key)
            elif key == "format" and isinstance(value, str) and value not in FORMATS:
                note(f"format {value!r}")
            elif key == "$ref" and isinstance(value, str) and not value.startswith("#"):
                note(f"$ref {value!r} (only references within the schema)")
            if key in ("properties", "patternProperties", "$defs", "definitions"):
                walk(value, in_properties=True)
            elif key not in ("enum", "const", "default", "examples"):
                walk(value)

    walk(schema)
    return found
