"""Grammar workers (runtime/grammar_pool.py): masks filled in worker processes equal the
fresh-matcher oracle bit for bit, step after step, their matchers following the committed
tokens there; engine output with workers equals plain constrained decoding under EAGLE-3,
the overlapped loop and random K, with every step's masks in the workers and with steps
alternating between them and the engine; ended requests' matchers and unused grammars leave
the workers; a dead worker fails the step with its name, never a hang."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from specserve import LLM, Grammar, SamplingParams
from specserve.core.errors import ConfigError
from specserve.runtime import grammar, grammar_pool
from tests.runtime.test_grammar_fill import EOS, TEXTS, _advance, _oracle_row
from tests.speculative.test_grammar import _every_grammar
from tests.support.overlap_cases import (
    generate,
    make_models,
    prompts_for,
    random_draft_lens,
    spec_kwargs,
)
from tests.support.tiny_models import VOCAB, make_tokenizer


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    """A compiler of the tiny tokenizer with two workers."""
    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    compiler = grammar.GrammarCompiler(tok, VOCAB, [EOS])
    compiler.start_workers(2)
    yield tok, compiler
    compiler.close()


def test_worker_masks_equal_fresh_matchers_step_after_step(compiler):
    tok, compiler = compiler
    rng = random.Random(5)
    texts = [(g, tok.encode(t, add_special_tokens=False) + [EOS]) for g in TEXTS for t in TEXTS[g]]
    requests = []  # [compiled, key, tokens, committed so far, its remote matcher]
    for _ in range(24):
        g, tokens = rng.choice(texts)
        compiled, key = compiler.compile(g), (g.kind, g.source)
        requests.append([compiled, tokens, rng.randint(0, 3), compiler.pool.remote(compiled, key)])
    words = xgr.get_bitmask_shape(1, VOCAB)[1]
    for step in range(6):
        jobs, expected, row = [], {}, 0
        for req in requests:
            compiled, tokens, at, remote = req
            req[2] = at = min(len(tokens), at + rng.randint(0, 3))  # committed tokens grow
            drafts = [  # mostly legal, some not
                (
                    tokens[at + k]
                    if rng.random() < 0.7 and at + k < len(tokens)
                    else rng.randrange(VOCAB)
                )
                for k in range(rng.choice([0, 1, 3]))
            ]
            row += rng.randint(0, 1)  # an unconstrained request's row between
            new = remote.new_tokens(tokens[:at], [])
            jobs.append((remote, new, row, drafts))
            for j in range(len(drafts) + 1):
                expected[row + j] = _oracle_row(_advance(compiled, tokens[:at], drafts[:j])[0])
            row += len(drafts) + 1
        bitmask, _ = compiler.masks.take(row, torch.device("cpu"))
        assert bitmask.shape == (row, words)
        compiler.pool.collect(compiler.pool.send(bitmask, compiler.masks.file, jobs))
        free = torch.full((words,), -1, dtype=torch.int32)
        for r in range(row):
            assert torch.equal(bitmask[r], expected.get(r, free)), (step, r)
    for req in requests:
        req[3].release()
    assert [w.live for w in compiler.pool.workers] == [0, 0]


def test_buffers_that_grow_unevenly_stay_mapped_and_grammars_travel_once(compiler):
    """The engine's two mask buffers take turns and each grows on its own (rows 64, 300,
    100, 200, 250, 100: one grows twice while the other stays): every step's rows still
    reach the worker's mapping of the right buffer. A grammar goes to a worker once while
    it holds it, also after its last request ended (unused, kept)."""
    tok, compiler = compiler
    g = Grammar("regex", r"(ab|c){2,5}!")  # (a grammar no worker holds yet)
    compiled, key = compiler.compile(g), (g.kind, g.source)
    tokens = tok.encode("abcab!", add_special_tokens=False)
    sent = []
    for rows in (64, 300, 100, 200, 250, 100):
        remote = compiler.pool.remote(compiled, key)
        sent.append(remote.grammar is not None)
        bitmask, _ = compiler.masks.take(rows, torch.device("cpu"))
        bitmask.fill_(7)  # (take resets it: whatever the worker leaves must be its mask)
        first = rows - 2
        job = (remote, tokens[:2], first, [])
        compiler.pool.collect(compiler.pool.send(bitmask, compiler.masks.file, [job]))
        want = _oracle_row(_advance(compiled, tokens[:2], [])[0])
        assert torch.equal(bitmask[first], want), rows
        assert torch.equal(bitmask[first + 1], torch.full_like(want, 7))
        remote.release()
    # two workers, the fewest-live one taken each time: each is sent the grammar once
    assert sum(sent) <= 2 and sent[0]
    assert not any(Path(f[2]).exists() for f in compiler.masks.files if f is not None)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


@pytest.fixture(scope="module")
def plain(models):
    prompts, params, _ = _every_grammar()
    return generate(models, prompts, params, "off")[1]


def _pooled(models, drafter="eagle3", overlap="on", **kw):
    """An LLM with two grammar workers, started (by the first grammar) and ready."""
    spec = spec_kwargs(models, drafter)
    llm = LLM(models["target"], overlap_schedule=overlap, grammar_workers=2, **spec, **kw)
    compiler = llm.engine.runner.grammars
    assert compiler.pool is None  # none until a request brings a grammar
    compiler.compile(Grammar("json"))
    compiler.pool.wait_ready()
    return llm


@pytest.mark.parametrize("min_rows", [1, 40])
def test_workers_keep_plain_constrained_output(models, plain, min_rows, monkeypatch):
    """min_rows 1: every step's masks in the workers; 40: steps with fewer constrained rows
    (random K: 24 to 96 a step) in the engine, so matchers switch sides. Masks sent from
    the overlapped loop let it process the step in flight before this one samples."""
    monkeypatch.setattr(grammar_pool, "CACHED_UNUSED", 1)  # grammars leave the workers too
    prompts, params, names = _every_grammar()
    llm = _pooled(models)
    random_draft_lens(llm)
    compiler = llm.engine.runner.grammars
    compiler.pool_min_rows = min_rows
    sides = {"workers": 0, "engine": 0}
    send, fill_masks = compiler.pool.send, grammar.fill_masks

    def in_workers(*a):
        sides["workers"] += 1
        return send(*a)

    def in_engine(*a):
        sides["engine"] += 1
        return fill_masks(*a)

    compiler.pool.send = in_workers
    monkeypatch.setattr(grammar, "fill_masks", in_engine)
    loop, runner = llm.engine.loop, llm.engine.runner
    start, early = runner.start_masks, []

    def start_masks(step):  # (sent from the loop: the step in flight processed meanwhile)
        sent = start(step)
        early.append(sent)
        return sent

    runner.start_masks = start_masks
    outs = [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(prompts, params)]
    assert outs == plain, sorted({n for n, a, b in zip(names, outs, plain) if a != b})
    assert sides["workers"] > 0 and (sides["engine"] > 0) == (min_rows > 1), sides
    assert sum(early) > 0 and loop._early is None
    workers = compiler.pool.workers
    assert [w.live for w in workers] == [0, 0]  # every request's matcher let go
    assert all(len(w.unused) <= 1 for w in workers)
    assert sum(len(w.dropped_grammars) for w in workers) > 0  # evicted: to go next message
    llm.close()
    assert compiler.pool.closed and all(w.process.poll() is not None for w in workers)


def test_sampled_output_is_legal_with_workers(models):
    llm = _pooled(models, drafter="random")
    llm.engine.runner.grammars.pool_min_rows = 1
    g = Grammar("json")
    params = [SamplingParams(temperature=1.5, seed=i, max_tokens=20, grammar=g) for i in range(8)]
    outs = llm.generate(prompts_for(), params)
    for o in outs:
        matcher = xgr.GrammarMatcher(llm.engine.runner.grammars.compile(g))
        assert all(matcher.is_terminated() or matcher.accept_token(t) for t in o.token_ids)
    assert len({tuple(o.token_ids) for o in outs}) > 4
    llm.close()


def test_a_dead_worker_fails_the_step_by_name(models):
    llm = _pooled(models, drafter=None, overlap="off")
    compiler = llm.engine.runner.grammars
    compiler.pool_min_rows = 1
    for worker in compiler.pool.workers:
        worker.process.kill()
        worker.process.wait()
    params = SamplingParams(max_tokens=8, grammar=Grammar("json"))
    with pytest.raises(RuntimeError, match=r"grammar worker specserve-grammar-\d died"):
        llm.generate(prompts_for()[:2], [params, params])
    llm.close()


def test_workers_are_configured(models, monkeypatch):
    with pytest.raises(ConfigError, match="grammar_workers must be in"):
        LLM(models["target"], grammar_workers=-1)
    assert LLM(models["target"]).engine.runner.grammars.pool is None  # none on CPU by default
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    for cores, ranks, workers in [(16, 1, 4), (64, 1, 4), (8, 1, 2), (4, 1, 0), (16, 8, 0)]:
        monkeypatch.setattr(grammar_pool.os, "cpu_count", lambda n=cores: n)
        assert grammar_pool.default_workers(gpu, ranks) == workers, (cores, ranks)
        assert grammar_pool.default_workers(cpu, ranks) == 0
