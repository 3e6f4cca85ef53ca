"""Grammars compiled in the HTTP process (server/grammar_compile.py): within a time bound,
on threads of their own, and handed to the engine compiled, which loads them instead of
compiling them again on its step loop."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import xgrammar as xgr

from specserve.core.sampling_params import Grammar
from specserve.runtime.grammar import GrammarCompiler
from specserve.server.errors import APIError
from specserve.server.grammar_compile import GrammarChecker
from tests.support.tiny_models import VOCAB

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})


class _Stuck:
    """A compiler whose compiles wait until released (a schema that takes minutes)."""

    def __init__(self):
        self.release = threading.Event()
        self.started = 0

    def serialize(self, grammar: Grammar) -> str:
        self.started += 1
        self.release.wait(30)
        return "{}"


def test_a_grammar_past_the_time_bound_is_a_400_and_a_busy_compiler_a_503():
    stuck = _Stuck()
    checker = GrammarChecker(stuck, timeout_s=0.3, threads=1)

    async def run():
        slow = asyncio.create_task(checker.compiled(Grammar("json_schema", SCHEMA)))
        await asyncio.sleep(0.05)  # (it holds the one thread)
        waiting = checker.compiled(Grammar("regex", "a+", field="response_format"))
        return await asyncio.gather(slow, waiting, return_exceptions=True)

    try:
        slow, waiting = asyncio.run(run())
    finally:
        stuck.release.set()
    assert isinstance(slow, APIError) and slow.status == 400, slow
    assert "did not compile within 0.3 s" in slow.message and slow.param == "grammar"
    assert isinstance(waiting, APIError) and waiting.status == 503, waiting
    assert waiting.headers["Retry-After"] and waiting.param == "response_format"
    stuck.release.set()
    time.sleep(0.2)
    assert stuck.started == 1  # the one that found no thread never ran
    assert all(t.daemon for t in threading.enumerate() if t.name == "grammar-compile")


def test_the_engine_loads_the_servers_compiled_grammar(tiny_llama):
    """The checker's grammar carries its compiled form; an engine-side compiler with the
    same tokenizer loads it without compiling (a matcher of it accepts what the schema
    does); a compiled form that does not load is compiled instead; a refused schema is a
    400 naming the field without xgrammar's log prefix."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    server_side = GrammarCompiler(tokenizer, VOCAB, [2])
    checker = GrammarChecker(server_side)
    grammar = Grammar("json_schema", SCHEMA, field="response_format", prefix="<a>", suffix="</a>")
    compiled = asyncio.run(checker.compiled(grammar))
    assert compiled == grammar and compiled.compiled  # (the same grammar, compiled)
    assert asyncio.run(checker.compiled(grammar)).compiled is compiled.compiled  # kept
    with pytest.raises(APIError) as e:
        asyncio.run(checker.compiled(Grammar("json_schema", '{"type": "bogus"}')))
    assert e.value.status == 400 and "bogus" in e.value.message and ".cc:" not in e.value.message

    engine_side = GrammarCompiler(tokenizer, VOCAB, [2])
    engine_side._compiler_for_tokenizer()
    compiles = []
    real = engine_side._compiler

    class Spy:
        def __getattr__(self, name):
            if name.startswith("compile"):
                compiles.append(name)
            return getattr(real, name)

    engine_side._compiler = Spy()
    loaded = engine_side.compile(compiled)
    assert compiles == [] and engine_side.compile(compiled) is loaded
    matcher = xgr.GrammarMatcher(loaded)
    assert matcher.accept_string('<a>{"a": 12}</a>')
    assert not xgr.GrammarMatcher(loaded).accept_string('<a>{"a": "x"}')
    engine_side.compile(Grammar("json_schema", '{"type": "integer"}', compiled="not json"))
    assert compiles == ["compile_json_schema"]
