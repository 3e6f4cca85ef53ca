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
    """A compiler whose compiles wait until released (a schema that takes minutes): all of
    them (`release`), or the first one alone (`release_first`)."""

    def __init__(self):
        self.release, self.release_first = threading.Event(), threading.Event()
        self.started = 0

    def serialize(self, grammar: Grammar) -> str:
        self.started += 1
        if self.started == 1:
            while not (self.release.is_set() or self.release_first.is_set()):
                time.sleep(0.01)
        else:
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


def test_a_compile_that_waited_for_a_thread_is_told_to_retry():
    """The time bound covers the wait for a thread: a grammar whose compile started late
    (another held the one thread) is a 503 to retry, not a 400 telling it to simplify."""
    stuck = _Stuck()
    checker = GrammarChecker(stuck, timeout_s=0.6, threads=1)

    async def run():
        first = asyncio.create_task(checker.compiled(Grammar("json_schema", SCHEMA)))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(checker.compiled(Grammar("regex", "b+")))
        await asyncio.sleep(0.4)
        stuck.release_first.set()  # the first ends; the second starts 0.45 s into its 0.6
        return await asyncio.gather(first, second, return_exceptions=True)

    try:
        first, second = asyncio.run(run())
    finally:
        stuck.release.set()
    assert first.compiled == "{}"
    assert isinstance(second, APIError) and second.status == 503, second


def test_requests_with_one_grammar_share_its_compile():
    stuck = _Stuck()
    checker = GrammarChecker(stuck, timeout_s=5.0, threads=2)

    async def run():
        tasks = [checker.compiled(Grammar("json_schema", SCHEMA)) for _ in range(4)]
        waiting = asyncio.gather(*tasks)
        await asyncio.sleep(0.1)
        stuck.release.set()
        return await waiting

    outs = asyncio.run(run())
    assert stuck.started == 1 and {o.compiled for o in outs} == {"{}"}


def test_the_server_compiles_for_the_engines_end_ids(tiny_llama):
    """xgrammar loads a compiled grammar only for the stop ids it was compiled with: the
    server compiles with the engine's (EngineInfo: config and tokenizer ids, e.g. Llama 3's
    three), so the engine loads every grammar it is handed; with the tokenizer's id alone
    it could load none and compiled each again on its step loop."""
    from transformers import AutoTokenizer

    from specserve.server.inputs import InputProcessor
    from specserve.server.messages import EngineInfo

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    engine_ids = (0, 2)  # (the tokenizer's end id, 2, and another one from a config)
    info = EngineInfo("m", VOCAB, 512, 4096, 256, 4, eos_token_ids=engine_ids)
    inputs = InputProcessor(tokenizer, info)
    grammar = asyncio.run(inputs.grammar_checker.compiled(Grammar("json_schema", SCHEMA)))
    engine_side = GrammarCompiler(tokenizer, VOCAB, list(engine_ids))
    engine_side.compile(grammar)
    assert engine_side._load_failed == 0 and grammar.key in engine_side._loaded
    tokenizer_only = GrammarCompiler(tokenizer, VOCAB, [2])
    tokenizer_only.compile(grammar)  # (compiled again, as it was)
    assert tokenizer_only._load_failed == 1


def test_a_compiled_grammar_goes_to_the_engine_once():
    """The first request bringing a grammar carries it compiled, later ones its key alone,
    until LOADED_KEPT // 2 other grammars were sent since (the engine keeps LOADED_KEPT)."""
    from types import SimpleNamespace

    from specserve.core.sampling_params import SamplingParams
    from specserve.runtime.grammar import LOADED_KEPT, GrammarHandOver
    from specserve.server.engine_client import EngineClient
    from specserve.server.messages import AddRequest

    client = SimpleNamespace(_grammars_sent=GrammarHandOver())

    def sent(source: str) -> bool:
        grammar = Grammar("regex", source, compiled=f"<{source}>")
        request = AddRequest("r", [1], SamplingParams(grammar=grammar))
        EngineClient._hand_over(client, request)
        assert request.params.grammar == grammar
        return request.params.grammar.compiled is not None

    assert sent("a+") and not sent("a+")
    for i in range(LOADED_KEPT // 2):
        assert sent(f"b{i}+")
    assert sent("a+")


def test_a_prefix_past_the_basic_plane_matches(tiny_llama):
    from transformers import AutoTokenizer

    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(tiny_llama), VOCAB, [2])
    grammar = Grammar("json_schema", '{"type": "integer"}', prefix="\U0001f600", suffix="!")
    assert xgr.GrammarMatcher(compiler.compile(grammar)).accept_string("\U0001f60012!")
