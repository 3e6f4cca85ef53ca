"""JSON schemas checked for what xgrammar's (0.2.9) grammar of them would not enforce, each
found named with what to change (runtime/grammar_sources.py refuses them: `SchemaRefused`),
and rewritten where a rewrite is exact.

Measured (each with an instance xgrammar accepts that violates the schema: the tests keep
the list honest), xgrammar's grammar of a schema ignores
- keywords in UNENFORCED_KEYWORDS, formats outside FORMATS, references outside the schema;
- every keyword beside `$ref`; beside `enum` or `const` (their values are checked against
  those keywords here instead); beside `anyOf` or `oneOf`; a string's `pattern` beside its
  `format`, and the length beside either (a maxLength of LOOSE_MAX_LENGTH or more beside a
  format is let through unenforced: pydantic's HttpUrl has 2083); `multipleOf` on numbers,
  and on integers bounded
  on one side only or by a fraction; `required` names not in `properties`;
- a type's keywords without `type`, unless it takes the type from them (an object from
  `properties` or `additionalProperties`, an array from `items` or `prefixItems`).
It compiles schemas that allow no value into a grammar that produces one anyway (an empty
`anyOf`, `"type": []`, a `required` name that `additionalProperties: false` forbids, an
`enum` none of whose values fits its other keywords): refused.
Patterns are matched against the JSON text. One that can match without '"', '\\' and the
control characters is compiled into an automaton that leaves them out (escapes too: a subset
of its strings, all valid JSON); one that cannot (it needs such a character) or whose syntax
the automaton lacks is expanded as raw text instead, where a '"' or a newline goes in
unescaped (json.loads then fails): refused (`_raw_patterns`). Its non-ASCII characters alone
would take it there, so they are written as \\u escapes first.
Rewrites, all exact: an `enum`'s values that its other keywords refuse dropped; a required
name missing from `properties` added there with the schema additionalProperties gives it;
non-ASCII pattern characters escaped; length-bounded strings' characters (`schema_grammar`).
Undecided: a schema unsatisfiable otherwise (a pattern no string of its length matches, a
required property whose schema allows nothing...) still compiles, to a grammar that may
produce a value outside it; satisfiability is undecidable in general."""

from __future__ import annotations

import copy
from typing import NamedTuple

# Nested objects and arrays a schema may have: deeper ones are refused before anything
# recurses through them (Python's recursion limit came at ~480 levels: a 500)
MAX_SCHEMA_DEPTH = 100
TOO_DEEP = (
    f"the JSON schema is nested too deeply (more than {MAX_SCHEMA_DEPTH} levels of objects "
    "and arrays); flatten it, e.g. with $defs and $ref"
)


# JSON schema keywords xgrammar compiles but does not enforce (measured: it accepts an
# instance that violates them): refused by name rather than silently ignored. `oneOf` is
# enforced as anyOf (pydantic's unions produce it; their alternatives rarely overlap).
UNENFORCED_KEYWORDS = frozenset(
    "not if then else allOf uniqueItems contains dependentRequired dependentSchemas "
    "minContains maxContains".split()
)
FORMATS = frozenset(
    "email date time date-time duration ipv4 ipv6 hostname uuid uri uri-reference "
    "uri-template json-pointer relative-json-pointer".split()
)
# A maxLength this long beside a format is not refused (nor enforced: xgrammar drops it)
LOOSE_MAX_LENGTH = 256
# Formats no empty string has: a minLength of 1 beside one is no constraint (pydantic's AnyUrl)
_NONEMPTY_FORMATS = FORMATS - {"uri-reference", "uri-template", "json-pointer"}
# Each type's keywords, and those xgrammar takes a missing type from
TYPE_KEYWORDS = {
    "string": ("pattern", "minLength", "maxLength", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("items", "prefixItems", "minItems", "maxItems"),
    "object": (
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "minProperties",
        "maxProperties",
        "propertyNames",
    ),
}
_TYPE_FROM = {"object": ("properties", "additionalProperties"), "array": ("items", "prefixItems")}
# Keywords that constrain a value (the rest, title, description, default, $defs..., do not)
ASSERTIONS = frozenset(
    {"type", "enum", "const", "$ref", "anyOf", "oneOf", "additionalItems", "dependencies"}
    | {"unevaluatedItems", "unevaluatedProperties"}
    | {keyword for keywords in TYPE_KEYWORDS.values() for keyword in keywords}
)
# Where subschemas stand: maps of them, lists of them, one
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMAS = ("items", "additionalProperties", "additionalItems", "propertyNames")
_SCHEMAS += ("unevaluatedItems", "unevaluatedProperties")


class CheckedSchema(NamedTuple):
    """A JSON schema as xgrammar should take it (the one given where nothing was rewritten),
    what it asks for that its grammar would not enforce, and its patterns (`pattern`s and
    patternProperties' names: as rewritten -> as given)."""

    schema: object
    found: list[str]
    patterns: dict[str, str]


def unsupported_schema_features(schema) -> list[str]:
    """What a JSON schema asks for that its grammar would not enforce, each named once with
    what to change, in the order found (`check_schema`; patterns are checked as the grammar
    is built, `schema_grammar`)."""
    return check_schema(schema).found


def check_schema(schema) -> CheckedSchema:
    """The schema checked and rewritten (see the module), every subschema where xgrammar
    reads one (not inside keywords refused)."""
    if too_deep(schema):
        return CheckedSchema(schema, [TOO_DEEP], {})
    check = _Check(copy.deepcopy(schema))
    check.walk(check.root, None)
    return CheckedSchema(check.root if check.changed else schema, check.found, check.patterns)


def too_deep(value) -> bool:
    """Whether objects and arrays nest past MAX_SCHEMA_DEPTH in `value` (without recursion)."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            if depth >= MAX_SCHEMA_DEPTH:
                return True
            stack.extend((child, depth + 1) for child in node)
    return False


class _Check:
    """One schema's walk: what it found, its patterns, whether it rewrote the schema."""

    def __init__(self, root):
        self.root, self.found, self.changed = root, [], False
        self.patterns: dict[str, str] = {}  # as rewritten -> as given
        self._valid = None  # (schema, value) -> bool, made on first use (`_values`)

    def note(self, what: str) -> None:
        if what not in self.found:
            self.found.append(what)

    def walk(self, node, implied_type: str | None) -> None:
        if not isinstance(node, dict):
            return
        self._check(node, implied_type)
        values = "enum" in node or "const" in node  # (they alone matter: `_values`)
        for key, value in node.items():
            if key in UNENFORCED_KEYWORDS or values and key not in ("$defs", "definitions"):
                continue  # (refused already, or not in the grammar)
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for child in value.values():
                    self.walk(child, None)
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                for child in value:
                    self.walk(child, None)
            elif key in _SCHEMAS:
                self.walk(value, "string" if key == "propertyNames" else None)

    def _check(self, node: dict, implied_type: str | None) -> None:
        note = self.note
        for key in node:
            if key in UNENFORCED_KEYWORDS:
                note(key)
        form, ref = node.get("format"), node.get("$ref")
        if isinstance(form, str) and form not in FORMATS:
            note(f"format {form!r}")
        if isinstance(ref, str) and not ref.startswith("#"):
            note(f"$ref {ref!r} (only references within the schema)")
        if node.get("type") == []:
            note('"type": [] (it allows no value: name at least one type)')
        for key in ("anyOf", "oneOf"):
            if node.get(key) == []:
                note(f"an empty {key} (it allows no value: give it at least one schema)")
        self._patterns(node)
        # xgrammar takes the first of these alone: $ref, then enum and const, then anyOf / oneOf
        beside = [k for k in node if k in ASSERTIONS]
        if "$ref" in node:
            self._alone(node, "$ref", beside, "the referenced schema")
        elif "enum" in node or "const" in node:
            self._values(node, [k for k in beside if k not in ("enum", "const")])
        elif "anyOf" in node or "oneOf" in node:
            key = "anyOf" if "anyOf" in node else "oneOf"
            self._alone(node, key, beside, f"each of its schemas, or drop the {key}")
        else:
            self._typed(node, implied_type)

    def _alone(self, node: dict, key: str, beside: list[str], where: str) -> None:
        others = [k for k in beside if k != key]
        if others:
            self.note(
                f"{key} beside {_names(others)} (xgrammar takes the {key} alone: move them "
                f"into {where})"
            )

    def _typed(self, node: dict, implied_type: str | None) -> None:
        """A type's keywords where the type is known (given, implied or taken from them);
        refused without one."""
        given = node.get("type", implied_type)
        types = {given} if isinstance(given, str) else set()
        if isinstance(given, list):
            types = {t for t in given if isinstance(t, str)}
        if given is None:
            types = {t for t, keys in _TYPE_FROM.items() if any(k in node for k in keys)}
        if given is None and not types:
            for kind, keys in TYPE_KEYWORDS.items():
                for key in (k for k in keys if k in node):
                    self.note(
                        f'{key} without a type (xgrammar ignores it there: add "type": "{kind}")'
                    )
            return
        if "string" in types:
            self._string(node)
        if "multipleOf" in node and types & {"number", "integer"}:
            self._multiple_of(node, types)
        if "object" in types:
            self._required(node)

    def _string(self, node: dict) -> None:
        if "pattern" in node and "format" in node:
            self.note("pattern beside format (xgrammar takes the format alone: use one)")
        advice = {
            "format": "drop the length, or use a pattern instead of the format",
            "pattern": "put the length in the pattern, e.g. ^[a-z]{1,8}$",
        }
        for key in ("format", "pattern"):
            if key not in node:
                continue
            implied = 1 if key == "format" and node[key] in _NONEMPTY_FORMATS else 0
            shortest = node.get("minLength", 0)
            longest = node.get("maxLength")
            # (a format's values are short: a bound of LOOSE_MAX_LENGTH or more beside one,
            # pydantic's HttpUrl's 2083, is let through unenforced rather than refused)
            loose = key == "format" and isinstance(longest, int) and longest >= LOOSE_MAX_LENGTH
            lengths = ["maxLength"] if longest is not None and not loose else []
            if not (isinstance(shortest, (int, float)) and shortest <= implied):
                lengths.insert(0, "minLength")
            if lengths:
                self.note(
                    f"{key} beside {_names(lengths)} (xgrammar ignores the length there: "
                    f"{advice[key]})"
                )

    def _multiple_of(self, node: dict, types: set) -> None:
        step = node["multipleOf"]
        low = "minimum" in node or "exclusiveMinimum" in node
        high = "maximum" in node or "exclusiveMaximum" in node
        if "number" in types:
            self.note('multipleOf on a number (xgrammar ignores it: use "type": "integer")')
        elif not (isinstance(step, int) or isinstance(step, float) and step.is_integer()):
            self.note(f"multipleOf {step} on an integer (only whole steps are enforced)")
        elif low != high:
            self.note(
                "multipleOf on an integer bounded on one side (xgrammar enforces it with "
                "bounds on both sides or none)"
            )

    def _required(self, node: dict) -> None:
        """Required names missing from properties: added there (with the schema
        additionalProperties gives them), or refused where that is not exact."""
        required, properties = node.get("required"), node.get("properties", {})
        if not isinstance(required, list) or not isinstance(properties, dict):
            return
        missing = [name for name in required if isinstance(name, str) and name not in properties]
        extra = node.get("additionalProperties", True)
        for name in missing:
            if "patternProperties" in node:
                self.note(
                    f"required {name!r} beside patternProperties (xgrammar ignores it unless "
                    "it is in properties: list it there)"
                )
            elif extra is False:
                self.note(
                    f"required {name!r}, which additionalProperties false forbids (it allows "
                    "no object: list it in properties or drop it)"
                )
        if missing and "patternProperties" not in node and extra is not False:
            given = extra if isinstance(extra, dict) else {}
            node["properties"] = {**properties, **{n: copy.deepcopy(given) for n in missing}}
            self.changed = True

    def _values(self, node: dict, others: list[str]) -> None:
        """enum and const beside other keywords, which xgrammar ignores: an enum's values
        those refuse dropped, a const they refuse (or no value left) refused."""
        if not others and not ("enum" in node and "const" in node):
            return
        valid = self._validity()
        names = _names(others or ["enum"])
        if valid is None:  # (jsonschema missing: nothing to check them with)
            self.note(f"enum or const beside {names} (xgrammar takes the values alone)")
            return
        try:
            if "const" in node and not valid(_without(node, "const"), node["const"]):
                self.note(
                    f"const {node['const']!r}, which its schema's {names} refuse (the grammar "
                    "would produce it anyway): change one of them"
                )
            enum = node.get("enum")
            if isinstance(enum, list):
                kept = [v for v in enum if valid(_without(node, "enum"), v)]
                if not kept:
                    self.note(
                        f"an enum none of whose values its schema's {names} allow (it allows "
                        "no value): change one of them"
                    )
                elif len(kept) < len(enum):
                    node["enum"] = kept
                    self.changed = True
        except Exception as e:  # (an unresolvable reference, a malformed keyword)
            self.note(f"enum or const beside {names}, which could not be checked ({e})")

    def _validity(self):
        if self._valid is None:
            try:
                from jsonschema import Draft202012Validator
                from jsonschema.validators import validator_for
                from referencing import Registry
            except ImportError:
                return None
            root = self.root if isinstance(self.root, dict) else {}
            kind = validator_for(root, default=Draft202012Validator)
            # (no registry to fetch from: references stay within the schema)
            base = kind(root, registry=Registry(), format_checker=kind.FORMAT_CHECKER)
            self._valid = lambda schema, value: base.evolve(schema=schema).is_valid(value)
        return self._valid

    def _patterns(self, node: dict) -> None:
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            node["pattern"] = self._pattern(pattern)
        named = node.get("patternProperties")
        if isinstance(named, dict):
            node["patternProperties"] = {self._pattern(p): s for p, s in named.items()}

    def _pattern(self, pattern: str) -> str:
        escaped = _escaped(pattern)
        self.changed |= escaped != pattern
        self.patterns[escaped] = pattern
        return escaped


def _escaped(pattern: str) -> str:
    """The pattern with its characters outside printable ASCII as \\u escapes (the same
    regular expression), which xgrammar compiles as an automaton where it can."""
    out = []
    for c in pattern:
        if " " <= c <= "~":
            out.append(c)
            continue
        backslashes = 0
        while backslashes < len(out) and out[-1 - backslashes] == "\\":
            backslashes += 1
        if backslashes % 2:  # an escaped character: the character itself
            out.pop()
        code = ord(c)
        out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\u{{{code:x}}}")
    return "".join(out)


def _without(node: dict, key: str) -> dict:
    return {k: v for k, v in node.items() if k != key}


def _names(keys: list[str]) -> str:
    return ", ".join(repr(k) for k in keys)
