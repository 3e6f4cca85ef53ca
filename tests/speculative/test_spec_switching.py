"""Switching speculation on and off per step costs nothing in correctness and leaves the
drafter fresh: acceptance right after a pause equals acceptance without the pause."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from specserve.speculative.policy import PerRequestPolicy
from tests.support.spies import spy_on
from tests.support.tiny_models import VOCAB, make_random_eagle3_head, make_tiny_model

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = make_tiny_model(tmp_path_factory.mktemp("t"), "llama", num_layers=4)
    draft = make_tiny_model(tmp_path_factory.mktemp("d"), "llama", seed=3, num_layers=1)
    head = make_random_eagle3_head(tmp_path_factory.mktemp("h"), target, 300)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 8, 15, 21)]
    return str(target), {"draft": str(draft), "eagle3": str(head)}, prompts


def _record(llm):
    """(request, committed length before the step, drafted, accepted) per verify step."""
    seen = []
    spec = llm.engine.spec
    observe = spec.observe

    def wrapped(batch, committed, draft_ms, target_ms):
        for s in batch:
            if s.drafts:
                n = committed.get(id(s), 1)
                before = s.request.committed_len - n
                seen.append((s.request.prompt_token_ids[0], before, len(s.drafts), n - 1))
        observe(batch, committed, draft_ms, target_ms)

    spy_on(spec, "observe", wrapped)
    return seen


def _assert_same_acceptance(ref, got):
    """Drafts depend only on the committed context: at the same (request, length) with the
    same draft length the same number of drafts is accepted, whatever came before."""
    by_key = {(r, length, k): a for r, length, k, a in ref}
    matched = [(tuple(g[:3]), g[3]) for g in got if tuple(g[:3]) in by_key]
    assert len(matched) >= 3
    for key, a in matched:
        assert by_key[key] == a


@pytest.mark.parametrize(
    "algo, ride_along", [("draft", False), ("eagle3", False), ("eagle3", True)]
)
def test_acceptance_after_pause_equals_acceptance_without(setup, algo, ride_along, monkeypatch):
    """ride_along: the EAGLE-3 head consumes queued features during the pause (threshold
    lowered to 2 steps) instead of catching up all at once when drafting resumes."""
    if ride_along:
        monkeypatch.setattr("specserve.speculative.eagle3.CATCH_UP_STEPS", 2)
    target, drafters, prompts = setup
    kw = dict(
        speculative_algorithm=algo,
        speculative_draft_model_path=drafters[algo],
        speculative_num_steps=3,
    )
    always = LLM(target, speculative_policy="fixed", **kw)
    ref = _record(always)
    plain = always.generate(prompts, GREEDY)

    paused = LLM(target, speculative_policy="fixed", **kw)
    counter = {"n": 0}

    def pause_often(req):
        counter["n"] += 1
        return 0 if (counter["n"] // 7) % 2 == 0 else 3  # stretches of 7 without drafting

    paused.engine.spec.policy = PerRequestPolicy(3, pause_often)
    got = _record(paused)
    proposer, catch_ups = paused.engine.spec.proposer, []
    propose = proposer.propose
    spy_on(
        proposer,
        "propose",
        lambda items: (catch_ups.extend(it for it in items if it.draft_len == 0), propose(items)),
    )
    outs = paused.generate(prompts, GREEDY)
    assert bool(catch_ups) == ride_along
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]

    _assert_same_acceptance(ref, got)


def test_per_request_speculation_state_is_dropped(setup):
    """Finished and aborted requests leave no acceptance estimates behind (a long-running
    server would otherwise grow without bound)."""
    target, drafters, prompts = setup
    llm = LLM(
        target,
        speculative_algorithm="draft",
        speculative_draft_model_path=drafters["draft"],
        speculative_policy="fixed",
    )
    llm.generate(prompts, GREEDY)
    engine = llm.engine
    rid = engine.add_request(prompts[0], GREEDY)
    for _ in range(4):
        engine.step()
    assert rid in engine.spec.acceptance._per_request
    engine.abort_request(rid)
    assert engine.spec.acceptance._per_request == {}
    assert engine.kv.allocator.num_used == 0


@pytest.mark.parametrize("lone", [False, True])
def test_prompt_catch_up_in_prefill_changes_no_draft(setup, monkeypatch, lone):
    """The EAGLE-3 head takes the prompt in the prefill steps (each chunk up to the pair
    before its last position): after every chunk the drafter has seen all but the chunk's
    last position, and the drafts of every step are those of a drafter that caught up on
    the whole prompt in its first drafting step instead. lone: a 17-token prompt alone, so
    the prefill stops one token short (a chunk of 16) and the next step feeds the last
    prompt token as a drafting decode, which must still have a pair to catch up on."""
    from specserve.speculative.eagle3 import Eagle3Proposer

    target, drafters, prompts = setup
    if lone:
        prompts = [list(range(5, 22))]
    else:
        prompts = prompts + [list(range(5, 45))]  # 40 tokens: 3 chunks of at most 16
    kw = dict(
        speculative_algorithm="eagle3",
        speculative_draft_model_path=drafters["eagle3"],
        speculative_num_steps=3,
        speculative_policy="fixed",
        max_num_batched_tokens=16,
    )

    def drafts_of(llm):
        seen, observe = [], llm.engine.spec.observe

        def wrapped(batch, committed, draft_ms, target_ms):
            seen.extend(
                (s.request.prompt_token_ids[0], s.request.committed_len, tuple(s.drafts))
                for s in batch
                if s.drafts
            )
            observe(batch, committed, draft_ms, target_ms)

        spy_on(llm.engine.spec, "observe", wrapped)
        return seen, llm.generate(prompts, GREEDY)

    llm = LLM(target, **kw)
    chunks, catch_up = [], Eagle3Proposer.catch_up_prefill

    def recorded(self, items):
        catch_up(self, items)
        chunks.extend(
            (
                len(it.request.prompt_token_ids),
                it.request.cached_len,
                it.request.committed_len,
                it.request.draft_cached_len,
            )
            for it in items
        )

    monkeypatch.setattr(Eagle3Proposer, "catch_up_prefill", recorded)
    with_prefill, outs = drafts_of(llm)
    if lone:
        assert [(c, n) for _, c, n, _ in chunks] == [(16, 17)]  # then a decode feeds the 17th
    else:
        assert sum(n == 40 for n, *_ in chunks) >= 3
        assert any(cached < committed for _, cached, committed, _ in chunks)  # mid-prompt
    assert all(drafted == cached - 1 for _, cached, _, drafted in chunks)

    monkeypatch.setattr(Eagle3Proposer, "catch_up_prefill", lambda self, items: None)
    without, ref = drafts_of(LLM(target, **kw))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert len(with_prefill) > (8 if lone else 20) and with_prefill == without


@pytest.mark.parametrize("algo", ["draft", "eagle3"])
def test_long_catch_ups_run_in_bounded_passes(setup, algo):
    """Requests that drafted nothing for 20 tokens all catch up in one step: with a step
    budget of 16 tokens the drafter's passes stay within it (plus the step's own pass: a
    host pair and the step in flight's tokens per request, at most K + 2), and output and
    acceptance equal those of drafting all along."""
    target, drafters, prompts = setup
    kw = dict(
        speculative_algorithm=algo,
        speculative_draft_model_path=drafters[algo],
        speculative_num_steps=3,
        speculative_policy="fixed",
        max_num_batched_tokens=16,
    )
    always = LLM(target, **kw)
    ref = _record(always)
    plain = always.generate(prompts, GREEDY)

    late = LLM(target, **kw)
    late.engine.spec.policy = PerRequestPolicy(3, lambda r: 0 if r.num_generated < 20 else 3)
    got = _record(late)
    proposer, passes = late.engine.spec.proposer, []
    module = proposer.head if algo == "eagle3" else proposer.model
    forward = module.forward

    def counted(ids_or_embeds, *args, **kwargs):
        passes.append(ids_or_embeds.shape[0])
        return forward(ids_or_embeds, *args, **kwargs)

    spy_on(module, "forward", counted)
    outs = late.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    bound = 16 + len(prompts) * (3 + 2)
    assert passes and max(passes) <= bound
    assert sum(passes) > bound  # the catch-up was longer than one pass may take
    _assert_same_acceptance(ref, got)


def test_bounded_passes_keep_every_token_once_in_order():
    from specserve.runtime.packing import Segment
    from specserve.speculative.proposer import bounded_passes

    rng = random.Random(0)
    segments = [
        Segment([i], rng.randrange(50), list(range(rng.randrange(1, 30)))) for i in range(9)
    ]
    passes = bounded_passes(segments, 7)
    assert all(sum(len(s.token_ids) for s in p) <= 7 for p in passes)
    for seg in segments:
        pieces = [(n, s) for n, p in enumerate(passes) for s in p if s.page_table is seg.page_table]
        assert [t for _, s in pieces for t in s.token_ids] == list(seg.token_ids)
        assert [s.start for _, s in pieces] == [
            seg.start + sum(len(s.token_ids) for _, s in pieces[:i]) for i in range(len(pieces))
        ]
        assert len({n for n, _ in pieces}) == len(pieces)  # one piece per pass, passes in order
        assert [n for n, _ in pieces] == sorted(n for n, _ in pieces)


class _DormantThenDrafting(PerRequestPolicy):
    """Plain decoding and a dormant drafter for the first tokens of every request, then K=3
    (the goodput policy's dormancy, forced)."""

    def __init__(self, plain_tokens: int):
        super().__init__(3, lambda r: 0 if r.num_generated < plain_tokens else 3)
        self.plain_tokens = plain_tokens
        self.dormant = True

    def choose(self, reqs, load=None):
        draft_lens = super().choose(reqs) if load is None else super().choose(reqs, load)
        self.dormant = not any(draft_lens)
        return draft_lens


def test_a_dormant_drafter_takes_no_upkeep_and_drafts_exactly_after_waking(setup):
    """While the policy is dormant the EAGLE-3 head takes neither prompt chunks nor
    ride-alongs (threshold at its default, the pause longer than it); the first drafting
    step catches up on everything, in bounded passes, and output and acceptance equal those
    of drafting all along."""
    from specserve.speculative.eagle3 import Eagle3Proposer

    target, drafters, prompts = setup
    kw = dict(
        speculative_algorithm="eagle3",
        speculative_draft_model_path=drafters["eagle3"],
        speculative_num_steps=3,
        speculative_policy="fixed",
        max_num_batched_tokens=16,
    )
    params = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    always = LLM(target, **kw)
    ref = _record(always)
    plain = always.generate(prompts, params)

    late = LLM(target, **kw)
    late.engine.spec.policy = _DormantThenDrafting(140)  # past CATCH_UP_STEPS (128)
    got = _record(late)
    proposer, upkeep = late.engine.spec.proposer, []
    catch_up = Eagle3Proposer.catch_up_prefill
    spy_on(
        proposer,
        "catch_up_prefill",
        lambda items: (upkeep.append(len(items)), catch_up(proposer, items)),
    )
    propose, policy, ride_alongs = proposer.propose, late.engine.spec.policy, []

    def spied(items, prev=None):
        if policy.dormant:
            ride_alongs.extend(it for it in items if it.draft_len == 0)
        return propose(items, prev)

    spy_on(proposer, "propose", spied)
    assert late.engine.spec.keeps_drafter is False
    eager_before = late.engine.stats()["spec_drafter_eager_passes"]
    outs = late.generate(prompts, params)
    assert upkeep == []  # no prompt chunk caught up while dormant (nor after: none left)
    assert ride_alongs == []
    stats = late.engine.stats()  # (metrics: steps with the upkeep stopped, eager passes)
    assert 0 < stats["spec_dormant_steps"] < stats["steps"]
    assert stats["spec_drafter_eager_passes"] > eager_before  # the catch-ups (on the CPU)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    _assert_same_acceptance(ref, got)


def _ride_along_passes(target, head, prompts, monkeypatch, join):
    """Outputs and catch-up-only passes of plain steps with the EAGLE-3 drafter kept up
    (a schedule of K=0), requests joining every third step, ride-alongs after 8 tokens."""
    monkeypatch.setattr("specserve.speculative.eagle3.CATCH_UP_STEPS", 8)
    monkeypatch.setattr("specserve.speculative.eagle3.RIDE_ALONG_JOIN", join)
    llm = LLM(
        target,
        speculative_algorithm="eagle3",
        speculative_draft_model_path=head,
        speculative_policy="schedule",
        speculative_schedule="1:0",
    )
    engine, passes = llm.engine, []
    proposer = engine.spec.proposer
    propose = proposer.propose

    def counted(items, prev=None):
        if all(it.draft_len == 0 for it in items):
            passes.append(len(items))
        return propose(items, prev)

    spy_on(proposer, "propose", counted)
    pending, outputs, step = list(prompts), {}, 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:
            engine.add_request(pending.pop(0), GREEDY)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        step += 1
    return [outputs[k] for k in sorted(outputs)], passes


def test_ride_alongs_share_a_pass(setup, monkeypatch):
    """Requests that reach the catch-up bound on different steps (they joined on
    different steps) take the requests near it along: fewer catch-up passes than each on
    its own, the same tokens (and those of speculation off)."""
    target, drafters, prompts = setup
    off = LLM(target, speculative_policy="off").generate(prompts, GREEDY)
    alone, alone_passes = _ride_along_passes(target, drafters["eagle3"], prompts, monkeypatch, 1)
    shared, shared_passes = _ride_along_passes(target, drafters["eagle3"], prompts, monkeypatch, 4)
    assert alone == shared == [o.token_ids for o in off]
    assert max(alone_passes) == 1  # (each request on its own step: they joined apart)
    assert max(shared_passes) > 1 and len(shared_passes) < len(alone_passes)
