"""What a JSON schema's grammar enforces (runtime/grammar_sources.py): patterns xgrammar
would match against the raw JSON text with a '"', '\\' or control character in it, keyword
combinations it silently drops and schemas that allow no value are refused by name; exact
rewrites (an enum's values filtered by their siblings, required names added to properties,
non-ASCII pattern characters escaped) enforce what the schema says; typical pydantic
schemas pass untouched; a schema nested past Python's recursion is refused, never a
RecursionError. Each refusal is kept honest by an instance xgrammar alone accepts although
the schema refuses it (`jsonschema` decides)."""

from __future__ import annotations

import json
from enum import Enum
from typing import Literal

import jsonschema
import pytest
import xgrammar as xgr
from pydantic import AnyUrl, BaseModel, Field, HttpUrl, constr

from specserve import Grammar
from specserve.core.errors import InvalidRequestError
from specserve.runtime.grammar_sources import SchemaRefused, schema_grammar
from specserve.runtime.schema_checks import TOO_DEEP, unsupported_schema_features

accepts = xgr.testing._is_grammar_accept_string


def _xgrammar_alone(schema) -> xgr.Grammar:
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def _refusal(schema) -> str:
    with pytest.raises(SchemaRefused) as e:
        schema_grammar(json.dumps(schema))
    return str(e.value)


# (pattern, JSON text xgrammar alone accepts for it: raw '"', '\' or control characters)
RAW_PATTERNS = [
    ('^a"b$', '"a"b"'),
    ("^a\\\\$", '"a\\"'),
    ("^a\\nb$", '"a\nb"'),
    ("^a\\tb$", '"a\tb"'),
    ("^[\\x00-\\x1f]$", '"\x05"'),
    ('^["]$', '"""'),
    ("^\\u0022$", '"""'),
    ("^\\x22+$", '""""'),
    ('^é"$', '"é""'),
]


@pytest.mark.parametrize(("pattern", "raw"), RAW_PATTERNS)
def test_a_pattern_matched_as_raw_json_text_is_refused(pattern, raw):
    """xgrammar expands such a pattern as raw text (it needs a character JSON escapes):
    its output failed json.loads."""
    schema = {"type": "string", "pattern": pattern}
    assert accepts(_xgrammar_alone(schema), raw)
    with pytest.raises(ValueError):
        json.loads(raw)
    assert f"pattern {pattern!r}" in _refusal(schema)
    nested = {"type": "object", "patternProperties": {pattern: {"type": "integer"}}}
    assert f"pattern {pattern!r}" in _refusal(nested)  # (a key's pattern alike)


@pytest.mark.parametrize(
    ("pattern", "matching", "other"),
    [
        ("^a.b$", "axb", ['a"b', "a\\b", "a\nb"]),
        ("^[^x]$", "y", ['"', "\\", "\n"]),
        ("^\\s\\S\\W$", " a!", ['\n"\\']),
        ("^[ -~]{2}$", "ab", ['a"', "\\\\"]),
        ('^(a|")$', "a", ['"']),
        ("^[à-ü]+$", "üà", ["a"]),  # (escaped as \u00e0-\u00fc: an automaton)
        ("^[^é]$", "a", ['"', "é"]),  # (raw text before: '"' passed unescaped)
        ("^😀+$", "😀😀", ["a"]),
    ],
)
def test_patterns_compiled_as_automata_give_valid_json_only(pattern, matching, other):
    """A pattern that can match without '"', '\\' and control characters becomes an
    automaton that leaves them out, escapes included: every string it gives is valid JSON
    and matches the pattern (a subset of the pattern's strings)."""
    grammar = schema_grammar(json.dumps({"type": "string", "pattern": pattern}))
    assert accepts(grammar, json.dumps(matching, ensure_ascii=False))
    for text in other:
        assert not accepts(grammar, json.dumps(text, ensure_ascii=False)), text
        assert not accepts(grammar, f'"{text}"'), text


# (what the refusal names, the schema, an instance xgrammar alone accepts that violates it)
STRING, INTEGER, OBJECT = {"type": "string"}, {"type": "integer"}, {"type": "object"}
REF = {"$defs": {"s": STRING}, "$ref": "#/$defs/s"}
IGNORED = [
    ("pattern beside 'maxLength'", {**STRING, "pattern": "^a+$", "maxLength": 2}, "aaaa"),
    ("pattern beside 'minLength'", {**STRING, "pattern": "^a*$", "minLength": 3}, "a"),
    ("format beside 'maxLength'", {**STRING, "format": "date", "maxLength": 3}, "2020-01-01"),
    ("format beside 'minLength'", {**STRING, "format": "date", "minLength": 20}, "2020-01-01"),
    ("pattern beside format", {**STRING, "format": "email", "pattern": "^z"}, "a@b.co"),
    ("$ref beside 'maxLength'", {**REF, "maxLength": 2}, "abc"),
    ("$ref beside 'const'", {**REF, "const": "a"}, "b"),
    ("$ref beside 'type'", {**REF, "type": "integer"}, "x"),
    ("anyOf beside 'type', 'required'", {**OBJECT, "required": ["a"], "anyOf": [OBJECT]}, {}),
    ("anyOf beside 'minimum'", {"minimum": 5, "anyOf": [INTEGER]}, 1),
    ("oneOf beside 'type', 'maxLength'", {**STRING, "maxLength": 1, "oneOf": [STRING]}, "abc"),
    ("anyOf beside 'oneOf'", {"anyOf": [STRING], "oneOf": [INTEGER]}, "x"),
    ("multipleOf on a number", {"type": "number", "multipleOf": 0.5}, 0.3),
    ("multipleOf on an integer bounded on one side", {**INTEGER, "multipleOf": 3, "minimum": 0}, 4),
    ("multipleOf 1.5 on an integer", {**INTEGER, "multipleOf": 1.5, "minimum": 0, "maximum": 9}, 1),
    ("pattern without a type", {"pattern": "^a$"}, "b"),
    ("minLength without a type", {"minLength": 3}, "b"),
    ("minimum without a type", {"minimum": 3}, 1),
    ("maxItems without a type", {"maxItems": 1}, [1, 2]),
    ("required without a type", {"required": ["a"]}, {}),
    ("minProperties without a type", {"minProperties": 1}, {}),
    (
        "required 'zz' beside patternProperties",
        {**OBJECT, "patternProperties": {"^z": INTEGER}, "required": ["zz"]},
        {},
    ),
]


@pytest.mark.parametrize(("named", "schema", "instance"), IGNORED, ids=[c[0] for c in IGNORED])
def test_combinations_xgrammar_drops_are_refused_by_name(named, schema, instance):
    assert not jsonschema.Draft202012Validator(schema).is_valid(instance)
    assert accepts(_xgrammar_alone(schema), json.dumps(instance))
    assert named in _refusal(schema)
    assert any(named in found for found in unsupported_schema_features(schema))


# (schema, an instance xgrammar alone accepts that violates it, an instance that fits)
REWRITTEN = [
    ({"type": "string", "enum": ["abc", "d"], "maxLength": 1}, "abc", "d"),
    ({"type": "integer", "enum": [1, "a", 7], "minimum": 2}, "a", 7),
    ({"enum": ["ab", "c"], "anyOf": [{"pattern": "^a"}]}, "c", "ab"),
    ({"type": "object", "required": ["zz"]}, {}, {"zz": [1]}),
    ({"type": "object", "properties": {"a": {}}, "required": ["z"]}, {"a": 1}, {"z": 1}),
    ({**OBJECT, "additionalProperties": INTEGER, "required": ["z"]}, {}, {"z": 3}),
    ({"type": ["object", "null"], "required": ["z"]}, {}, {"z": None}),
]


@pytest.mark.parametrize(("schema", "violating", "fitting"), REWRITTEN)
def test_exact_rewrites_enforce_what_xgrammar_dropped(schema, violating, fitting):
    """An enum's values its other keywords refuse are dropped; a required name missing from
    properties is added there with the schema additionalProperties gives it."""
    assert unsupported_schema_features(schema) == []
    assert accepts(_xgrammar_alone(schema), json.dumps(violating))
    grammar = schema_grammar(json.dumps(schema))
    assert not accepts(grammar, json.dumps(violating))
    assert accepts(grammar, json.dumps(fitting))
    jsonschema.validate(fitting, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(violating, schema)


# (what the refusal names, a schema that allows no value, the value xgrammar produced)
UNSATISFIABLE = [
    ("an empty anyOf", {"anyOf": []}, None),
    ("an empty oneOf", {"type": "object", "properties": {"a": {"oneOf": []}}}, None),
    ('"type": []', {"type": []}, None),
    ("const 1, which its schema's 'type' refuse", {"type": "string", "const": 1}, 1),
    ("an enum none of whose values", {"type": "integer", "enum": ["a"]}, "a"),
    (
        "required 'a', which additionalProperties false forbids",
        {**OBJECT, "properties": {}, "required": ["a"], "additionalProperties": False},
        {},
    ),
    ("pattern beside 'minLength'", {**STRING, "pattern": "^$", "minLength": 1}, ""),
]


@pytest.mark.parametrize(("named", "schema", "produced"), UNSATISFIABLE)
def test_schemas_that_allow_no_value_are_refused(named, schema, produced):
    if produced is not None:  # (what xgrammar's grammar let through)
        assert accepts(_xgrammar_alone(schema), json.dumps(produced))
        assert not jsonschema.Draft202012Validator(schema).is_valid(produced)
    assert named in _refusal(schema)


class Color(Enum):
    RED = "red"
    GREEN = "green"


class Address(BaseModel):
    street: str
    zip_code: constr(max_length=10)
    country: Literal["NL", "DE"] = "NL"


class Person(BaseModel):
    name: str = Field(description="full name", max_length=40)
    age: int = Field(ge=0, le=150)
    nickname: str | None = None
    tags: list[str] = Field(default_factory=list, max_length=5)
    color: Color
    home: Address
    other: list[Address] | None = None
    site: AnyUrl | None = None  # (format uri, minLength 1: implied by the format)
    page: HttpUrl | None = None  # (format uri, maxLength 2083: let through, unenforced)
    scores: dict[str, int] = {}
    kind: Literal["person"] = "person"


def test_typical_pydantic_schemas_compile_untouched():
    for model in (Person, Address):
        schema = model.model_json_schema()
        assert unsupported_schema_features(schema) == [], model
        grammar = schema_grammar(json.dumps(schema))
        example = {"street": "Main 1", "zip_code": "1234 AB", "country": "DE"}
        if model is Address:
            assert accepts(grammar, json.dumps(example))
            assert not accepts(grammar, json.dumps({**example, "zip_code": "x" * 11}))


def _nested(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_schema_nested_too_deeply_is_refused_not_a_recursion_error():
    """Refused past MAX_SCHEMA_DEPTH without recursing through it: as a JSON string
    (engine side, json.loads included) and as a value (the server's, before json.dumps)."""
    import tempfile
    from pathlib import Path

    from specserve.runtime.grammar import GrammarCompiler
    from tests.support.tiny_models import VOCAB, make_tokenizer

    assert unsupported_schema_features(_nested(49)) == []
    assert unsupported_schema_features(_nested(60)) == [TOO_DEEP]
    deep = '{"type": "object", "properties": {"a": ' * 600 + "{}" + "}}" * 600
    compiler = GrammarCompiler(make_tokenizer(Path(tempfile.mkdtemp())), VOCAB, [2])
    with pytest.raises(InvalidRequestError, match="nested too deeply") as e:
        compiler.compile(Grammar("json_schema", deep, field="response_format"))
    assert e.value.field == "response_format"
