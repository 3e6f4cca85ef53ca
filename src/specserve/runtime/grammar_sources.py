"""A grammar's source as xgrammar (0.2.9) takes it: a JSON schema's grammar, checked
(runtime/schema_checks.py: what it would not enforce, refused by name with what to change)
and rewritten where a rewrite is exact (length-bounded strings made of JSON's string
characters, patterns all compiled as automata); text as an EBNF literal; xgrammar's errors
without their log prefix. (The compiled grammars, matchers and each step's masks:
runtime/grammar.py.)"""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from specserve.runtime.schema_checks import check_schema

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
# A pattern compiled as an automaton, as xgrammar prints it (C escapes of printable ASCII)
_AUTOMATON = re.compile(r'Regex\("((?:[^"\\]|\\.)*)", json_string=true\)')


class SchemaRefused(Exception):
    """A JSON schema that structured output would not enforce: what (`found`), each named
    with what to change."""

    def __init__(self, found: list[str]):
        self.found = found
        super().__init__(
            "the JSON schema uses what structured output cannot enforce: " + "; ".join(found)
        )


def schema_grammar(source: str) -> xgr.Grammar:
    """A JSON schema's grammar (no whitespace beyond what JSON needs), checked and rewritten
    (`check_schema`; SchemaRefused), its patterns all compiled as automata (`_raw_patterns`),
    its length-bounded strings made of JSON's string characters (`_BOUNDED_CHARACTERS`)."""
    schema = json.loads(source)
    checked = check_schema(schema)
    if checked.found:
        raise SchemaRefused(checked.found)
    if checked.schema is not schema:
        source = json.dumps(checked.schema)
    grammar = xgr.Grammar.from_json_schema(source, any_whitespace=False)
    text = str(grammar)
    raw = _raw_patterns(checked.patterns, text)
    if raw:
        raise SchemaRefused(
            [
                f"pattern {p!r} (it needs a '\"', a '\\' or a control character, which the "
                "grammar would write unescaped, or syntax the pattern engine lacks): leave "
                "those out of it"
                for p in raw
            ]
        )
    text, bounded = _BOUNDED_CHARACTERS.subn(_JSON_CHARACTER, text)
    if not bounded:
        return grammar
    return xgr.Grammar.from_ebnf(f"{text}\n{_JSON_ESCAPE}\n", root_rule_name="root")


def _raw_patterns(patterns: dict[str, str], text: str) -> list[str]:
    """The patterns (as given) xgrammar expands as raw text rather than as automata. The
    grammar's text names those it made automata; one it does not name (ignored where it
    stands, or printed otherwise) is compiled alone to see."""
    automata = {re.sub(r"\\(.)", r"\1", p) for p in _AUTOMATON.findall(text)}
    raw = []
    for pattern, given in patterns.items():
        if pattern in automata:
            continue
        alone = json.dumps({"type": "string", "pattern": pattern})
        try:
            if "Regex(" not in str(xgr.Grammar.from_json_schema(alone)):
                raw.append(given)
        except RuntimeError:  # (unused where it stands, or the grammar would have failed)
            pass
    return raw


def ebnf_text(text: str) -> str:
    """`text` as an EBNF string literal (characters past U+FFFF as themselves: a JSON
    escape would write them as two surrogates, which match nothing)."""
    return json.dumps(text, ensure_ascii=False)


def compile_error(e: Exception) -> str:
    """What xgrammar's error says, without its log prefix (time, C++ source file and line)."""
    reason = str(e).split("Check failed:")[-1].strip()
    return _LOG_PREFIX.sub("", reason)
