"""Grammars compiled for the HTTP process (server/grammar_compile.py): within a time bound,
in worker processes that are ended past it, and handed to the engine compiled, which loads
them instead of compiling them again on its step loop."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import replace

import psutil
import pytest
import xgrammar as xgr

from specserve.core.sampling_params import Grammar
from specserve.runtime.grammar import GrammarCompiler, compile_in_worker
from specserve.server.errors import APIError
from specserve.server.grammar_compile import GrammarChecker
from tests.support.tiny_models import VOCAB

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})


def _task(grammar: Grammar):
    """A compile worker's task: a regex "sleep S LOG" notes the worker's pid in the file
    LOG, sleeps S seconds and compiles nothing ("pid"); any other grammar is compiled."""
    if grammar.kind == "regex" and grammar.source.startswith("sleep "):
        _, seconds, log = grammar.source.split(" ", 2)
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(float(seconds))
        return str(os.getpid()), None
    return compile_in_worker(grammar)


def _sleep(seconds: float, log) -> Grammar:
    return Grammar("regex", f"sleep {seconds} {log}")


def _started(log) -> list[str]:
    return log.read_text().split() if log.exists() else []


@pytest.fixture
def checker(tiny_llama):
    """A checker of one worker over the tiny tokenizer, its worker started (a second or
    two: the bounds below start counting once it is there)."""
    from transformers import AutoTokenizer

    grammars = GrammarCompiler(AutoTokenizer.from_pretrained(tiny_llama), VOCAB, [2])
    checker = GrammarChecker(grammars, timeout_s=120.0, workers=1, task=_task)
    asyncio.run(checker.compiled(Grammar("regex", "warm+")))
    yield checker
    checker.close()


def test_a_grammar_past_the_time_bound_is_ended_a_400_and_a_queued_one_a_503(checker, tmp_path):
    """xgrammar's own slow case (seconds to compile) is ended at the bound with its worker;
    a grammar queued behind it all that time never starts and is told to retry."""
    log = tmp_path / "log"
    checker.timeout_s = 1.0
    slow_schema = json.dumps({"type": "string", "pattern": "[a-z]{0,9000}"})

    async def run():
        slow = asyncio.create_task(checker.compiled(Grammar("json_schema", slow_schema)))
        await asyncio.sleep(0.1)  # (it holds the one worker)
        queued = checker.compiled(replace(_sleep(0, log), field="response_format"))
        return await asyncio.gather(slow, queued, return_exceptions=True)

    slow, queued = asyncio.run(run())
    assert isinstance(slow, APIError) and slow.status == 400, slow
    assert "did not compile within 1 s" in slow.message and slow.param == "grammar"
    assert isinstance(queued, APIError) and queued.status == 503, queued
    assert queued.headers["Retry-After"] and queued.param == "response_format"
    checker.timeout_s = 120.0
    # the worker that ran the slow compile was ended; the queued grammar never ran
    pid = asyncio.run(checker.compiled(_sleep(0, tmp_path / "after"))).compiled
    assert _started(log) == [] and _started(tmp_path / "after") == [pid]


def test_a_worker_that_died_idle_is_replaced(checker, tmp_path):
    """A compile worker killed while idle (out of memory, say) put the pool in its error
    state for good: every later compile failed (a 500) until the server restarted."""
    pid = int(asyncio.run(checker.compiled(_sleep(0.01, tmp_path / "log"))).compiled)
    psutil.Process(pid).kill()  # (not reaped here: pebble's manager must see it end)
    deadline = time.monotonic() + 30  # (pebble's manager notices the dead worker)
    while checker._pool.active and time.monotonic() < deadline:
        time.sleep(0.1)
    compiled = asyncio.run(checker.compiled(Grammar("json_schema", SCHEMA)))
    assert compiled.compiled is not None


def test_a_compile_that_starts_within_the_bound_is_waited_for(checker, tmp_path):
    """A grammar queued behind another but started before its bound ran out is waited for
    (its own bound ends it), not refused for the time it waited."""
    checker.timeout_s = 3.0

    async def run():
        first = asyncio.create_task(checker.compiled(_sleep(2.0, tmp_path / "first")))
        await asyncio.sleep(0.1)
        second = checker.compiled(_sleep(1.5, tmp_path / "second"))  # starts ~2 s in
        return await asyncio.gather(first, second, return_exceptions=True)

    first, second = asyncio.run(run())
    assert first.compiled == second.compiled, (first, second)  # (one worker ran both)


def test_requests_with_one_grammar_share_its_compile(checker, tmp_path):
    grammar = _sleep(0.5, tmp_path / "log")

    async def run():
        return await asyncio.gather(*(checker.compiled(grammar) for _ in range(4)))

    outs = asyncio.run(run())
    assert len(_started(tmp_path / "log")) == 1 and len({o.compiled for o in outs}) == 1


def test_a_compile_nobody_waits_for_is_ended(checker, tmp_path):
    """A client that goes away takes its grammar's compile with it: the worker running it
    is ended (another starts), not left compiling for nobody."""
    log = tmp_path / "log"

    async def run():
        gone = asyncio.create_task(checker.compiled(_sleep(60, log)))
        while not _started(log):
            await asyncio.sleep(0.05)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        return await checker.compiled(Grammar("regex", "next+"))

    start = time.monotonic()
    assert asyncio.run(run()).compiled
    assert time.monotonic() - start < 50  # (not after the 60 s compile: a bound, no timing)
    (pid,) = _started(log)
    assert not psutil.pid_exists(int(pid)) or psutil.Process(int(pid)).status() == "zombie"


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
    assert compiles == ["compile_grammar"]  # (a schema: runtime/grammar_sources.py)


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


def test_a_waiting_requests_grammar_stays_loaded_until_its_request_goes(tiny_llama):
    """A grammar travels compiled once, then by key alone (GrammarHandOver). The engine
    keeps the LOADED_KEPT least recently loaded grammars and every one a live request's
    Grammar uses: a request that travelled key-only and waits while LOADED_KEPT other
    grammars arrive finds its own when its matcher is made (it was compiled again from
    source there, on the step loop: seconds for some schemas); once its Grammar is gone
    the grammar goes like any other."""
    import gc

    from transformers import AutoTokenizer

    from specserve.runtime.grammar import LOADED_KEPT

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    server_side = GrammarCompiler(tokenizer, VOCAB, [2])
    engine_side = GrammarCompiler(tokenizer, VOCAB, [2])

    def sent(source: str) -> Grammar:
        grammar = Grammar("regex", source)
        return replace(grammar, compiled=server_side.serialize(grammar))

    first = sent("a+")
    engine_side.compile(first)  # (added: the engine compiles a grammar as it queues it)
    waiting = replace(first, compiled=None)  # the next request with it, key-only
    engine_side.compile(waiting)
    del first  # (its request ended)
    others = [sent(f"b{i}+") for i in range(LOADED_KEPT + 1)]
    for grammar in others:
        engine_side.compile(grammar)
    del others, grammar
    compiles = []
    real = engine_side._compiler

    class Spy:
        def __getattr__(self, name):
            if name.startswith("compile"):
                compiles.append(name)
            return getattr(real, name)

    engine_side._compiler = Spy()
    xgr.GrammarMatcher(engine_side.compile(waiting))  # its matcher, made when it runs
    assert compiles == []
    del waiting
    gc.collect()
    for i in range(LOADED_KEPT + 1):
        engine_side.compile(sent(f"c{i}+"))
    assert ("regex", "a+", "", "") not in engine_side._loaded
    assert len(engine_side._loaded) <= LOADED_KEPT + 1


def test_a_forced_calls_tool_schema_nested_too_deeply_is_refused_naming_tools():
    """Refused before anything recurses through it (it was a RecursionError: a 500)."""
    from specserve.core.errors import InvalidRequestError
    from specserve.server.tools import call_grammar

    schema = {"type": "integer"}
    for _ in range(600):
        schema = {"type": "object", "properties": {"a": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    with pytest.raises(InvalidRequestError, match="nested too deeply") as e:
        call_grammar([tool], "hermes")
    assert e.value.field == "tools"
