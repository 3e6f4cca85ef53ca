"""train-eagle3's data: prompt sources and the held-out split, self-distillation with the
engine (time budget, deadline, retry on the safe engine path), the draft vocabulary."""

from __future__ import annotations

import pytest
import torch

from specserve.train.distill import Sample, build_draft_vocab
from specserve.train.prompts import (
    PromptSourceError,
    jsonl_prompts,
    load_prompts,
    reserved_keys,
    shakespeare_prompts,
    stdlib_prompts,
)
from tests.support.train_cases import make_target, train_config, write_prompt_file


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("target4"))


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompt_file(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


def test_generation_time_budget(target):
    from specserve.core.config import EngineConfig
    from specserve.engine.engine import LLMEngine
    from specserve.train.distill import generate_samples
    from specserve.train.prompts import PromptItem

    engine = LLMEngine(EngineConfig.from_flags(model=str(target), max_num_seqs=2, num_kv_pages=64))
    prompts = [PromptItem(str(i), [{"role": "user", "content": f"hi {i}"}]) for i in range(6)]
    kw = dict(max_new_tokens=4, temperature=0.0, seed=0, max_prompt_tokens=64, progress=False)
    assert generate_samples(engine, prompts, time_budget_s=0.0, **kw) == []
    samples = generate_samples(engine, prompts, **kw)
    assert [s.key for s in samples] == [str(i) for i in range(6)]
    assert all(s.response_len == 4 for s in samples) and not engine.has_unfinished()


def test_prompts_too_large_for_the_engine_are_skipped_not_fatal(target):
    """A prompt within --max-prompt-tokens that leaves no room in the engine's context, or
    that the engine refuses for its KV cache, is skipped and counted: one such prompt
    ended the whole generation (and lost what it had made)."""
    from specserve.core.config import EngineConfig
    from specserve.engine.engine import LLMEngine
    from specserve.train.distill import Skipped, generate_samples
    from specserve.train.prompts import PromptItem

    engine = LLMEngine(
        EngineConfig.from_flags(
            model=str(target), max_num_seqs=2, num_kv_pages=4, page_size=16, max_model_len=64
        )
    )
    assert engine.kv.capacity_tokens == 48 and engine.max_model_len == 64
    words = {"short": 5, "fills the cache": 28, "fills the context": 50, "short too": 6}
    prompts = [
        PromptItem(key, [{"role": "user", "content": " ".join(["fox"] * n)}])
        for key, n in words.items()
    ]  # 19 tokens of chat template + one a word: 24, 47 (+ 8 > 48), 69 (>= 64), 25
    skipped = Skipped()
    kw = dict(max_new_tokens=8, temperature=0.0, seed=0, max_prompt_tokens=100, progress=False)
    samples = generate_samples(engine, prompts, skipped=skipped, **kw)
    assert [s.key for s in samples] == ["short", "short too"]
    assert skipped == Skipped(too_long=1, refused=1)
    assert all(s.response_len == 8 for s in samples) and not engine.has_unfinished()


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_generation_deadline_keeps_greedy_prefixes(target, monkeypatch, overlap):
    """Past budget + grace, running requests stop and their partial replies are kept: they
    are prefixes of the full greedy replies. A fake clock ticks once per reading."""
    from specserve.core.config import EngineConfig
    from specserve.engine.engine import LLMEngine
    from specserve.train import distill
    from specserve.train.prompts import PromptItem

    engine = LLMEngine(
        EngineConfig.from_flags(
            model=str(target), max_num_seqs=2, num_kv_pages=64, overlap_schedule=overlap
        )
    )
    prompts = [PromptItem(str(i), [{"role": "user", "content": f"hi {i}"}]) for i in range(6)]
    kw = dict(max_new_tokens=40, temperature=0.0, seed=0, max_prompt_tokens=64, progress=False)
    full = distill.generate_samples(engine, prompts[:2], **kw)
    ticks = iter(range(10**6))
    monkeypatch.setattr(distill.time, "monotonic", lambda: float(next(ticks)))
    cut = distill.generate_samples(
        engine, prompts, time_budget_s=1.5, grace_s=12.0, min_partial_tokens=3, **kw
    )
    assert [s.key for s in cut] == ["0", "1"]  # no prompt started after the budget
    for short, whole in zip(cut, full):
        assert 3 <= short.response_len < whole.response_len == 40
        assert short.token_ids == whole.token_ids[: len(short.token_ids)]
    monkeypatch.undo()
    again = distill.generate_samples(engine, prompts[:2], **kw)  # the engine stays usable
    assert [s.token_ids for s in again] == [s.token_ids for s in full]
    # Without detokenization (TokenIdsOnly, as train-eagle3 runs it): the same token ids.
    ids_only = LLMEngine(
        EngineConfig.from_flags(
            model=str(target), max_num_seqs=2, num_kv_pages=64, overlap_schedule=overlap
        ),
        tokenizer=distill.TokenIdsOnly(engine.tokenizer),
    )
    same = distill.generate_samples(ids_only, prompts[:2], **kw)
    assert [s.token_ids for s in same] == [s.token_ids for s in full]


def test_generation_retries_on_the_safe_engine_path(target, prompt_file, tmp_path, monkeypatch):
    """A failure of the fast generation engine is logged and generation runs again eagerly
    with the synchronous loop, so a fixed lease still trains."""
    from specserve.train import distill

    real, calls, records = distill.generate_samples, [], []

    def flaky(engine, *args, **kwargs):
        calls.append(engine.config.execution.disable_overlap_schedule)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(distill, "generate_samples", flaky)
    cfg = train_config(tmp_path, target, prompt_file, num_prompts=6, max_new_tokens=4)
    train_samples, heldout = distill.distill(cfg, tmp_path, records.append)
    assert len(train_samples) == 6 and len(heldout) == 4
    assert calls == [False, True, True]  # held-out on the fast engine fails; both again
    failed = [r for r in records if r.get("event") == "generation_failed"]
    assert len(failed) == 1 and "boom" in failed[0]["error"]
    # The user's own errors are not retried: they would fail the same way, later.
    from specserve.core.errors import InvalidRequestError

    def refused(engine, *args, **kwargs):
        calls.append("refused")
        raise InvalidRequestError("the prompt is empty", "prompt")

    monkeypatch.setattr(distill, "generate_samples", refused)
    calls.clear()
    again = tmp_path / "again"
    again.mkdir()
    with pytest.raises(InvalidRequestError):
        distill.distill(cfg, again, records.append)
    assert calls == ["refused"]


def test_draft_vocab_is_most_frequent_reply_tokens():
    samples = [Sample("a", [1, 2, 7, 7, 7, 9], 2), Sample("b", [3, 9, 9, 5], 1)]
    d2t, t2d, coverage = build_draft_vocab(samples, vocab_size=12, draft_vocab_size=3)
    ids = torch.arange(3) + d2t
    assert ids.tolist() == [5, 7, 9] and t2d.nonzero().flatten().tolist() == [5, 7, 9]
    assert coverage == 1.0
    d2t, t2d, coverage = build_draft_vocab(samples, vocab_size=12, draft_vocab_size=2)
    assert (torch.arange(2) + d2t).tolist() == [7, 9] and coverage == pytest.approx(6 / 7)
    # --min-draft-coverage: the smallest size (multiples of granularity) holding the share
    d2t, _, coverage = build_draft_vocab(samples, 12, 3, min_coverage=0.8, granularity=1)
    assert (torch.arange(2) + d2t).tolist() == [7, 9] and coverage == pytest.approx(6 / 7)
    d2t, _, coverage = build_draft_vocab(samples, 12, 3, min_coverage=0.9, granularity=1)
    assert len(d2t) == 3 and coverage == 1.0
    # A size past the vocabulary is the whole vocabulary, with or without the coverage
    for min_coverage in (None, 0.5):
        d2t, t2d, _ = build_draft_vocab(samples, 12, 100, min_coverage, granularity=1000)
        assert (torch.arange(12) + d2t).tolist() == list(range(12)) and bool(t2d.all())


def test_prompt_sources(tmp_path, prompt_file):
    lib = tmp_path / "lib"
    (lib / "test").mkdir(parents=True)
    code = (
        '"""A module docstring long enough to be worth summarizing: ' + "words " * 10 + '"""\n'
        "def visible(x):\n    '''Doc.'''\n    y = x + 1\n    return y * 2\n\n"
        "def _hidden(x):\n    a = 1\n    b = 2\n    return a + b\n\n"
        "class Box:\n    def put(self, item):\n        self.items = []\n"
        "        self.items.append(item)\n        return item\n"
    )
    (lib / "mod.py").write_text(code)
    (lib / "test" / "test_mod.py").write_text(code)
    keys = sorted(p.key.rsplit(":", 1)[0] for p in stdlib_prompts(lib))
    assert keys == ["stdlib:mod", "stdlib:mod.Box", "stdlib:mod.Box.put", "stdlib:mod.visible"]

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "play_gut.txt").write_text("THE PLAY\n" + "A line of verse, and more.\n" * 200)
    (texts / "play_gut_f.txt").write_text("folio duplicate\n" * 200)
    passages = shakespeare_prompts(texts)
    assert passages and all(p.key.startswith("shakespeare:play_gut:") for p in passages)
    # Variants: other kinds of request on the same text share its source key.
    three = shakespeare_prompts(texts, variants=3)
    assert len(three) == 3 * len(passages)
    first = [p for p in three if p.source_key == passages[0].key]
    assert len({p.messages[0]["content"] for p in first}) == 3  # three kinds of request
    assert {p.source_key for p in three} == {p.key for p in passages}
    assert sorted({p.variant for p in three}) == [0, 1, 2]
    two = stdlib_prompts(lib, variants=2)
    assert len(two) == 2 * len(keys) - 1  # the module docstring has one kind only
    reserved = reserved_keys(three, 0, 2)
    assert {p.source_key for p in three if p.source_key in reserved} == reserved

    items = jsonl_prompts(prompt_file)
    assert len(items) == 36 and all(p.messages[-1]["role"] == "user" for p in items)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "assistant", "content": "x"}]}\n')
    with pytest.raises(PromptSourceError, match="no user turn"):
        jsonl_prompts(bad)
    with pytest.raises(PromptSourceError, match="neither"):
        load_prompts(["no-such-source"], 0, None, 0)
    train_a, held_a = load_prompts([str(prompt_file)], 3, 20, 5)
    train_b, held_b = load_prompts([str(prompt_file)], 3, 20, 5)
    assert [p.key for p in train_a] == [p.key for p in train_b] and len(train_a) == 20
    assert len(held_a) == 5 and not {p.key for p in held_a} & {p.key for p in train_a}
    assert len(load_prompts([str(prompt_file)], 0, None, 40)[1]) == 36  # all held out


def test_heldout_split_does_not_depend_on_other_prompts():
    from specserve.train.prompts import PromptItem

    items = [PromptItem(f"src:{i}", []) for i in range(3000)]
    fewer = items[::2] + [PromptItem(f"other:{i}", []) for i in range(500)]
    a, b = reserved_keys(items, 0, 8), reserved_keys(fewer, 0, 8)
    common = {p.key for p in items} & {p.key for p in fewer}
    assert a & common == b & common and 30 < len(a) < 90  # about 2% reserved


def test_init_heads_heldout_without_a_file_or_leaving_nothing(tmp_path):
    """--init-head without heldout_prompts.jsonl (a head from elsewhere) drops nothing and
    says so; a head's list is appended once a text (its repeats and variants of listed
    texts left out), on lines of its own; one whose held-out prompts are every training
    prompt is refused by name."""
    import json
    from types import SimpleNamespace

    from specserve.train.distill import keep_heldout_out
    from specserve.train.prompts import PromptSourceError

    train = [Sample("f.jsonl:0", [1, 2, 3], 1), Sample("f.jsonl:1#v1", [4, 5], 1)]
    head, out = tmp_path / "head", tmp_path / "out"
    head.mkdir()
    out.mkdir()
    logged = []
    cfg = SimpleNamespace(init_head=str(head))
    assert keep_heldout_out(cfg, out, train, logged.append) == train
    assert logged == [
        {
            "event": "heldout_kept_out",
            "init_head": str(head),
            "init_head_listed": False,
            "listed_now": 0,
            "held_out_prompts": 0,
            "dropped_samples": 0,
        }
    ]
    assert not (out / "heldout_prompts.jsonl").exists()
    assert keep_heldout_out(SimpleNamespace(init_head=None), out, train, 0) == train  # no log
    own = {"key": "g.jsonl:7", "messages": []}
    (out / "heldout_prompts.jsonl").write_text(json.dumps(own))  # (no newline at its end)
    rows = [
        {"key": "f.jsonl:1", "messages": []},
        {"key": "f.jsonl:1#v2", "messages": []},  # the same text again
        {"key": "g.jsonl:7#v1", "messages": []},  # a text the run holds out itself
    ]
    (head / "heldout_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert keep_heldout_out(cfg, out, train, logged.append) == train[:1]
    lines = (out / "heldout_prompts.jsonl").read_text().splitlines()
    assert lines == [json.dumps(own), json.dumps(rows[0])]
    assert logged[-1]["listed_now"] == 1 and logged[-1]["dropped_samples"] == 1
    (head / "heldout_prompts.jsonl").write_text(json.dumps({"key": "f.jsonl:0"}) + "\n")
    with pytest.raises(
        PromptSourceError, match="every training sample .*--init-head .*'s included"
    ):
        keep_heldout_out(cfg, out, train, logged.append)
