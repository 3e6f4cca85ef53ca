"""Greedy speculative output is token-identical to plain decoding, for every proposer, draft
length, page size, under preemption and with mixed per-request draft lengths."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from specserve.core.kv_cache import KVCache as KVCacheLike
from specserve.speculative.policy import PerRequestPolicy
from tests.support.tiny_models import VOCAB, make_tiny_model, resized_vocab_copy

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _prompts(seed=3):
    rng = random.Random(seed)
    lengths = [1, 4, 9, 16, 17, 23, 31, 40, 6]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]
    # Repetitive prompts give n-gram lookup something to find.
    prompts[1] = [7, 8, 9, 10] * 6
    prompts[5] = [50, 51, 52] * 9
    return prompts


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request, tmp_path_factory):
    folder = request.getfixturevalue(f"tiny_{request.param}")
    other = make_tiny_model(tmp_path_factory.mktemp("draft"), request.param, seed=7, num_layers=1)
    prompts = _prompts()
    plain = [o.token_ids for o in LLM(str(folder)).generate(prompts, GREEDY)]
    return str(folder), str(other), prompts, plain


def _run(folder, prompts, **kw):
    llm = LLM(folder, speculative_policy="fixed", **kw)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.kv.allocator.num_used == 0
    return llm, outs


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("drafter", ["copy", "random", "ngram"])
def test_greedy_identical(target, drafter, k):
    folder, other, prompts, plain = target
    if drafter == "ngram":
        kw = dict(speculative_algorithm="ngram")
    else:
        kw = dict(
            speculative_algorithm="draft",
            speculative_draft_model_path=folder if drafter == "copy" else other,
        )
    llm, outs = _run(folder, prompts, speculative_num_steps=k, page_size=16, **kw)
    assert [o.token_ids for o in outs] == plain
    stats = [o.spec_stats for o in outs]
    drafted = sum(s.drafted for s in stats)
    accepted = sum(s.accepted for s in stats)
    assert drafted > 0
    if drafter == "copy":
        assert accepted == drafted  # a drafter that is the target is always right
    if drafter == "random":
        assert accepted < drafted


def test_a_draft_model_of_a_shorter_context_drafts_past_it(tmp_path):
    """A draft model whose context (here 32 positions; or a sliding window, which cuts it)
    is shorter than the target's started, then failed the first step drafting past it
    (IndexError in its rotary table; under the server: the engine died). Its rotary covers
    the target's positions now; every draft is verified, so the output is the target's."""
    from tests.support.tiny_models import make_tiny_model as make

    target = make(tmp_path / "target", seed=3)
    short = make(tmp_path / "short", seed=3, overrides=dict(max_position_embeddings=32))
    prompt = [[7, 8, 9, 10] * 6]  # 24 tokens, 40 more past the draft's 32
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(str(target)).generate(prompt, params)[0].token_ids
    llm = LLM(
        str(target),
        speculative_algorithm="draft",
        speculative_draft_model_path=str(short),
        speculative_policy="fixed",
    )
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == plain and out.spec_stats.accepted > 0


def test_a_drafters_load_errors_name_its_flag(tmp_path):
    """A draft model's or an EAGLE-3 head's load error said what was wrong ('checkpoint
    lacks 1 tensor(s): fc.weight', a traceback for a corrupt file) but not that the
    drafter was at fault, after the target had loaded fine."""
    from specserve.core.errors import CheckpointError
    from tests.support.tiny_models import make_random_eagle3_head
    from tests.support.tiny_models import make_tiny_model as make

    target = make(tmp_path / "target", seed=3)
    draft = make(tmp_path / "draft", seed=4, num_layers=1)
    (draft / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(
        CheckpointError,
        match="--speculative-draft-model-path .*draft: .*is not a readable safetensors",
    ):
        LLM(str(target), speculative_algorithm="draft", speculative_draft_model_path=str(draft))
    deep = make(tmp_path / "deep", seed=3, num_layers=4)  # (a head reads 3 layers' features)
    head = make_random_eagle3_head(tmp_path / "head", deep)
    (head / "config.json").write_text("{not json")
    with pytest.raises(
        CheckpointError, match="--speculative-draft-model-path .*head: .*not valid JSON"
    ):
        LLM(str(deep), speculative_algorithm="eagle3", speculative_draft_model_path=str(head))


def _drafted_by(draft, target, prompts):
    """(llm, greedy outputs) of `target` with the draft model at `draft`, fixed K=3."""
    return _run(
        str(target),
        prompts,
        speculative_algorithm="draft",
        speculative_draft_model_path=str(draft),
        speculative_num_steps=3,
    )


def test_a_draft_models_embedding_may_be_padded_to_another_size(tmp_path):
    """A draft sharing the target's tokenizer with an embedding padded to another size
    (Qwen2.5-0.5B drafting for 7B: 151,936 rows against 152,064) was refused. Its logits
    are fitted to the target's ids now: a padded copy of the target drafts only what the
    target decodes (all accepted, so ids line up), a cut one (VOCAB - 8 rows: the
    tokenizer's size) is fed id 0 for the ids past its rows that a random target emits;
    greedy output is the target's, and sampled drafts (rejection sampling over the target's
    ids) run and free their pages."""
    target = make_tiny_model(tmp_path / "target", seed=3)
    prompts = _prompts()
    plain = [o.token_ids for o in LLM(str(target)).generate(prompts, GREEDY)]
    for vocab in (VOCAB + 64, VOCAB - 8):
        draft = resized_vocab_copy(target, tmp_path / f"draft{vocab}", vocab)
        llm, outs = _drafted_by(draft, target, prompts)
        assert [o.token_ids for o in outs] == plain
        drafted = sum(o.spec_stats.drafted for o in outs)
        accepted = sum(o.spec_stats.accepted for o in outs)
        if vocab > VOCAB:
            assert accepted == drafted > 0
        else:
            emitted = {t for o in outs for t in o.token_ids}
            assert max(emitted) >= vocab  # (ids the cut draft has no row for)
            assert 0 < accepted < drafted
        sampled = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, ignore_eos=True)
        outs = llm.generate(prompts, sampled)
        assert all(len(o.token_ids) == MAX_NEW for o in outs)
        assert sum(o.spec_stats.drafted for o in outs) > 0
        assert llm.engine.kv.allocator.num_used == 0


def test_a_draft_whose_special_tokens_differ_drafts(tmp_path):
    """Drafts are ordinary tokens: a draft whose added tokens differ (one renamed, as Llama
    3.1 renamed 3.0's reserved ones, and one more) or whose folder's tokenizer cannot be
    read (a tokenizer_config.json alone: taken on its vocabulary size, as before the
    tokenizers were compared) drafts, and the output is the target's."""
    import json

    target = make_tiny_model(tmp_path / "target", seed=3)
    prompts = _prompts()
    plain = [o.token_ids for o in LLM(str(target)).generate(prompts, GREEDY)]
    renamed = resized_vocab_copy(target, tmp_path / "renamed", VOCAB)
    path = renamed / "tokenizer.json"
    tok = json.loads(path.read_text())
    for added in tok["added_tokens"]:
        if added["content"] == "<|endoftext|>":
            added["content"] = "<|end_of_text|>"
    tok["model"]["vocab"]["<|end_of_text|>"] = tok["model"]["vocab"].pop("<|endoftext|>")
    path.write_text(json.dumps(tok))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (renamed / name).exists():
            text = (renamed / name).read_text()
            (renamed / name).write_text(text.replace("<|endoftext|>", "<|end_of_text|>"))
    from transformers import AutoTokenizer

    extended = AutoTokenizer.from_pretrained(str(renamed))
    extended.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    extended.save_pretrained(str(renamed))
    unreadable = resized_vocab_copy(target, tmp_path / "unreadable", VOCAB)
    (unreadable / "tokenizer.json").unlink()
    for draft in (renamed, unreadable):
        _, outs = _drafted_by(draft, target, prompts)
        assert [o.token_ids for o in outs] == plain
        assert (
            sum(o.spec_stats.accepted for o in outs) == sum(o.spec_stats.drafted for o in outs) > 0
        )


def test_a_draft_model_of_another_tokenizer_is_refused(tmp_path, monkeypatch):
    """A draft model whose tokenizer gives ids other meanings (here two tokens swapped:
    the same vocabulary size) was taken silently and every draft rejected; one of another
    size without a tokenizer cannot show it shares the target's. Both are said before the
    target's weights load, as an EAGLE-3 head made for another vocabulary is."""
    import json

    from specserve.core.errors import CheckpointError, UnsupportedModelError
    from specserve.engine import builder
    from tests.support.tiny_models import make_random_eagle3_head

    target = make_tiny_model(tmp_path / "target", seed=3)
    draft = make_tiny_model(tmp_path / "draft", seed=4, num_layers=1)
    path = draft / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tok))
    with pytest.raises(
        UnsupportedModelError,
        match=r"--speculative-draft-model-path .*draft: the draft model's tokenizer differs "
        r"from the target's \(2 of",
    ):
        LLM(str(target), speculative_algorithm="draft", speculative_draft_model_path=str(draft))
    bare = resized_vocab_copy(target, tmp_path / "bare", VOCAB + 64)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink(missing_ok=True)
    with pytest.raises(UnsupportedModelError, match="has no tokenizer to show"):
        LLM(str(target), speculative_algorithm="draft", speculative_draft_model_path=str(bare))
    deep = make_tiny_model(tmp_path / "deep", seed=3, num_layers=4)
    head = make_random_eagle3_head(tmp_path / "head", deep)
    wide = make_tiny_model(tmp_path / "wide", overrides=dict(vocab_size=VOCAB + 64))

    def loaded(*args, **kwargs):
        raise AssertionError("the target's weights were loaded first")

    monkeypatch.setattr(builder, "load_model", loaded)
    with pytest.raises(UnsupportedModelError, match="tokenizer differs"):
        LLM(str(target), speculative_algorithm="draft", speculative_draft_model_path=str(draft))
    with pytest.raises(CheckpointError, match="made for a vocabulary of 384 tokens"):
        LLM(str(wide), speculative_algorithm="eagle3", speculative_draft_model_path=str(head))


@pytest.mark.parametrize("mode", ["page1", "preemption", "chunked"])
def test_greedy_identical_modes(target, mode):
    folder, other, prompts, plain = target
    kw = {
        "page1": dict(page_size=1),
        "preemption": dict(page_size=4, num_kv_pages=24),
        "chunked": dict(page_size=4, max_num_batched_tokens=9),
    }[mode]
    for path in (folder, other):
        llm, outs = _run(
            folder,
            prompts,
            speculative_algorithm="draft",
            speculative_draft_model_path=path,
            speculative_num_steps=3,
            **kw,
        )
        assert [o.token_ids for o in outs] == plain
        if mode == "preemption":
            assert llm.engine.scheduler.num_preemptions > 0


def test_mixed_per_request_draft_lengths(target):
    """Random draft lengths per request and per step (0 included) change nothing."""
    folder, other, prompts, plain = target
    for path in (folder, other):
        llm = LLM(
            folder,
            speculative_algorithm="draft",
            speculative_draft_model_path=path,
            speculative_num_steps=7,
            speculative_policy="fixed",
        )
        rng = random.Random(11)
        seen = set()

        def draft_len(req, rng=rng, seen=seen):
            k = rng.choice([0, 0, 1, 2, 3, 5, 7])
            seen.add(k)
            return k

        llm.engine.spec.policy = PerRequestPolicy(7, draft_len)
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == plain
        assert {0, 7} <= seen
        assert llm.engine.kv.allocator.num_used == 0


def test_drafter_catches_up_after_pause(target):
    """After a stretch with no speculation the drafter catches up: a copy-drafter is still
    always right (its KV covers every committed token)."""
    folder, _, prompts, plain = target
    llm = LLM(
        folder,
        speculative_algorithm="draft",
        speculative_draft_model_path=folder,
        speculative_policy="fixed",
    )
    steps = {"n": 0}

    def draft_len(req):
        steps["n"] += 1
        return 0 if (steps["n"] // 20) % 2 == 0 else 3

    llm.engine.spec.policy = PerRequestPolicy(3, draft_len)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    stats = [o.spec_stats for o in outs]
    assert sum(s.drafted for s in stats) > 0
    assert sum(s.accepted for s in stats) == sum(s.drafted for s in stats)


def test_stop_inside_accepted_drafts(target):
    """A stop token among accepted drafts ends the request there, as without speculation."""
    folder, _, prompts, plain = target
    stop_at = plain[3][5]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop_at])
    expected = [o.token_ids for o in LLM(folder).generate(prompts, params)]
    llm = LLM(
        folder,
        speculative_algorithm="draft",
        speculative_draft_model_path=folder,
        speculative_num_steps=7,
        speculative_policy="fixed",
    )
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.kv.allocator.num_used == 0
    # A request's statistics count the tokens it kept: each verify step its accepted drafts
    # and one more (the first token is the prompt's), none past the stop.
    for o in outs:
        assert o.spec_stats.accepted + o.spec_stats.verify_steps == len(o.token_ids) - 1
        assert o.spec_stats.accepted <= o.spec_stats.drafted


def test_statistics_count_the_tokens_kept_at_max_tokens(target):
    """K=7 drafts and 3 tokens wanted: the one verify step keeps 2 tokens, so it counts
    one accepted draft of one needed (it counted 7 of 7, 8 tokens a step)."""
    folder, _, prompts, _ = target
    llm = LLM(
        folder,
        speculative_algorithm="draft",
        speculative_draft_model_path=folder,
        speculative_num_steps=7,
        speculative_policy="fixed",
    )
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for o in llm.generate(prompts, params):
        stats = o.spec_stats
        assert (stats.verify_steps, stats.drafted, stats.accepted) == (1, 1, 1)
        assert stats.mean_accept_len == 2.0


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def eagle_target(request, tmp_path_factory):
    from tests.support.tiny_models import make_random_eagle3_head

    folder = make_tiny_model(tmp_path_factory.mktemp("t4"), request.param, num_layers=4)
    head = make_random_eagle3_head(tmp_path_factory.mktemp("head"), folder, 200)
    prompts = _prompts()
    plain = [o.token_ids for o in LLM(str(folder)).generate(prompts, GREEDY)]
    return str(folder), str(head), prompts, plain


@pytest.mark.parametrize(
    "k, kw",
    [
        (1, dict(page_size=16)),
        (3, dict(page_size=1)),
        (7, dict(page_size=16)),
        (3, dict(page_size=4, num_kv_pages=24)),  # forced preemption
        (3, dict(page_size=4, max_num_batched_tokens=9)),  # chunked prefill
    ],
)
def test_eagle3_greedy_identical(eagle_target, k, kw):
    folder, head, prompts, plain = eagle_target
    llm, outs = _run(
        folder,
        prompts,
        speculative_algorithm="eagle3",
        speculative_draft_model_path=head,
        speculative_num_steps=k,
        **kw,
    )
    assert [o.token_ids for o in outs] == plain
    assert sum(o.spec_stats.drafted for o in outs) > 0
    if "num_kv_pages" in kw:
        assert llm.engine.scheduler.num_preemptions > 0


def test_eagle3_mixed_draft_lengths(eagle_target):
    folder, head, prompts, plain = eagle_target
    llm = LLM(
        folder,
        speculative_algorithm="eagle3",
        speculative_draft_model_path=head,
        speculative_num_steps=7,
        speculative_policy="fixed",
    )
    rng = random.Random(5)
    llm.engine.spec.policy = PerRequestPolicy(7, lambda req: rng.choice([0, 0, 1, 3, 7]))
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == plain
    assert llm.engine.kv.allocator.num_used == 0


def test_lookahead_never_costs_a_preemption():
    """When pages are short, a request gives up its draft lookahead (K drops to 0) before
    the scheduler preempts anyone: speculation's memory cost is only ever spare pages."""
    from specserve.core.kv_cache import PageAllocator
    from specserve.core.request import Request, RequestStatus
    from specserve.engine.scheduler import Scheduler
    from specserve.speculative.policy import FixedPolicy

    class Pool:  # the KVCache page logic without tensors
        page_size = 4
        allocator = PageAllocator(9)  # 8 usable pages = 32 tokens
        grow = KVCacheLike.grow
        release = KVCacheLike.release
        pages_needed = KVCacheLike.pages_needed

    sched = Scheduler(Pool(), max_num_seqs=8, max_num_batched_tokens=64)
    reqs = []
    for i in range(2):
        r = Request(
            f"r{i}",
            list(range(3, 17)),
            SamplingParams(max_tokens=40),
            arrival=i,
            seed=0,
            max_len=512,
            eos_token_ids=frozenset(),
        )
        r.output_token_ids = [5]  # committed 15, cached 14: decoding
        r.cached_len = 14
        assert Pool.grow(Pool(), r.page_table, 15)  # 4 pages each
        r.status = RequestStatus.RUNNING
        sched.running.append(r)
        reqs.append(r)
    batch = sched.schedule(FixedPolicy(7))
    assert sched.num_preemptions == 0
    assert [s.request for s in batch] == reqs
    assert all(s.num_tokens == 1 for s in batch)
    assert sum(s.draft_len for s in batch) < 14  # not both could have had their lookahead
