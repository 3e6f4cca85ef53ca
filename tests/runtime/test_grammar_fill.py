"""A step's grammar masks (runtime/grammar.py: fill_masks), filled position-major and
threaded over requests, equal bit for bit an oracle that fills each row with a fresh matcher
advanced through the drafts before it: many requests of three grammars, with legal, illegal
and grammar-ending drafts of differing counts, some past their grammar's end already. Rows
of other requests are left alone, and every matcher is left as it was."""

from __future__ import annotations

import contextlib
import json
import random
from collections import Counter

import pytest
import torch
import xgrammar as xgr

from specserve import Grammar
from specserve.runtime import grammar
from specserve.runtime.grammar_sources import schema_grammar
from tests.support.tiny_models import VOCAB

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "n": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    },
    "required": ["name", "ok"],
}
TEXTS = {  # valid outputs of each grammar
    Grammar("json_schema", json.dumps(SCHEMA)): [
        json.dumps({"name": "fox", "ok": True}),
        json.dumps({"name": "dog ab", "ok": False, "n": [1, 23]}),
    ],
    Grammar("regex", r"(ab|c){1,4}-[0-9]{2,3}"): ["abc-12", "c-123", "ababcab-99"],
    Grammar("json"): [json.dumps({"quick": [1, {"a": None}], "b": "x"}), "[true, 2.5]"],
}
UNTOUCHED = 0x5A5A5A5A


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """(compiled grammar, the tokens of a valid output and EOS) of each text."""
    from tests.support.tiny_models import make_tokenizer

    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    compiler = grammar.GrammarCompiler(tok, VOCAB, [EOS])
    return [
        (compiler.compile(g), tok.encode(text, add_special_tokens=False) + [EOS])
        for g, texts in TEXTS.items()
        for text in texts
    ]


def _request(rng: random.Random, outputs):
    """(compiled grammar, committed tokens, drafts): committed up to a random point of a valid
    output (its end included), drafts that mostly continue it, some EOS or random."""
    compiled, tokens = rng.choice(outputs)
    at = rng.randint(0, len(tokens))
    drafts = []
    for k in range(rng.choice([0, 1, 2, 3, 3, 4])):
        pick = rng.random()
        if pick < 0.6 and at + k < len(tokens):
            drafts.append(tokens[at + k])
        else:
            drafts.append(EOS if pick < 0.8 else rng.randrange(VOCAB))
    return compiled, tokens[:at], drafts


def _matcher(compiled, committed: list[int]) -> xgr.GrammarMatcher:
    matcher = xgr.GrammarMatcher(compiled)
    for token in committed:
        assert matcher.accept_token(token)
    return matcher


def _advance(compiled, committed: list[int], drafts: list[int]):
    """A fresh matcher through `committed`, then the longest legal run of `drafts` that
    stays within the grammar: (it, the drafts it took)."""
    matcher, taken = _matcher(compiled, committed), 0
    for token in drafts:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        taken += 1
    return matcher, taken


def _oracle_row(matcher: xgr.GrammarMatcher) -> torch.Tensor:
    """Its mask; every token past the grammar's end."""
    row = xgr.allocate_token_bitmask(1, VOCAB)
    if matcher.is_terminated():
        row[:] = -1
    else:
        matcher.fill_next_token_bitmask(row)
    return row[0]


def _case(compiled, committed: list[int], drafts: list[int]) -> str:
    matcher, taken = _advance(compiled, committed, drafts)
    if matcher.is_terminated():
        return "ended before" if taken == 0 and committed[-1:] == [EOS] else "ended by a draft"
    return "all legal" if taken == len(drafts) else "an illegal draft"


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("threads", [1, 4])
def test_batched_fill_equals_fresh_matchers_row_by_row(outputs, seed, threads, monkeypatch):
    monkeypatch.setattr(grammar, "THREADED_MIN_ROWS", 8)  # some positions threaded, some not
    rng = random.Random(seed)
    requests = [_request(rng, outputs) for _ in range(64)]
    cases = Counter(_case(*r) for r in requests)
    assert len(cases) == 4 and min(cases.values()) >= 3, cases  # every case, several times
    assert {len(d) for _, _, d in requests} == {0, 1, 2, 3, 4}
    spans, expected, row = [], [], 0
    for compiled, committed, drafts in requests:
        row += rng.randint(0, 2)  # rows of unconstrained requests between
        spans.append((_matcher(compiled, committed), row, drafts))
        expected.append(
            {
                row + j: _oracle_row(_advance(compiled, committed, drafts[:j])[0])
                for j in range(len(drafts) + 1)
            }
        )
        row += len(drafts) + 1
    words = xgr.get_bitmask_shape(1, VOCAB)[1]
    untouched = torch.full((words,), UNTOUCHED, dtype=torch.int32)
    batch_fill, sizes = grammar.BatchFill(threads), []

    def spy(matchers, bitmask, rows):  # (how many rows each fill had)
        sizes.append(len(matchers))
        batch_fill(matchers, bitmask, rows)

    for n in (64, 5, 1):  # the whole batch, a few requests, one
        bitmask = untouched.repeat(row + 1, 1)
        grammar.fill_masks(bitmask, spans[:n], spy)
        want = {r: mask for rows in expected[:n] for r, mask in rows.items()}
        for r in range(bitmask.shape[0]):
            assert torch.equal(bitmask[r], want.get(r, untouched)), (n, r)
        again = bitmask.clone()  # every matcher rolled back: filling again gives the same
        grammar.fill_masks(again, spans[:n], batch_fill)
        assert torch.equal(again, bitmask)
    assert {min(n, 2) if n < 8 else 8 for n in sizes} == {1, 2, 8}  # alone, on one, threaded


@pytest.mark.parametrize("bounds", [{"maxLength": 5}, {"minLength": 1, "maxLength": 3}])
def test_a_length_bounded_string_is_a_json_string(bounds):
    """xgrammar writes a string with a length bound as characters that let control
    characters through and no escape; schema_grammar's are JSON's: the bound kept, a control
    character refused, an escape (one character) taken. (json.loads is the oracle.)"""
    schema = {"type": "object", "properties": {"s": {"type": "string", **bounds}}}
    schema["required"] = ["s"]
    compiled = schema_grammar(json.dumps(schema))
    accepts = xgr.testing._is_grammar_accept_string
    for text in ['{"s": "ab"}', '{"s": "a\\"b"}', '{"s": "\\u00e9\\n"}', '{"s": "\x08"}']:
        value = None
        with contextlib.suppress(ValueError):
            value = json.loads(text)["s"]
        valid = value is not None and bounds.get("minLength", 0) <= len(value) <= 5
        valid = valid and len(value) <= bounds["maxLength"]
        assert accepts(compiled, text) == valid, text
    assert not accepts(compiled, '{"s": "abcdef"}')
