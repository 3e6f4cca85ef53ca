"""Shared pieces of the overlap-scheduling tests: tiny target, drafters and heads, prompts,
a runner comparing the loops, stop parameters built from reference outputs."""

from __future__ import annotations

import random

from specserve import LLM, SamplingParams
from specserve.speculative.policy import NO_LOAD, PerRequestPolicy, SpeculationPolicy
from tests.support.spies import spy_on
from tests.support.tiny_models import VOCAB, make_random_eagle3_head, make_tiny_model

GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
# (drafter, overlap, random K per request): the paths where a per-request logit change
# can go wrong under speculation (every drafter in both loops, mixed draft lengths)
SPECULATION_PATHS = [
    (drafter, overlap, False)
    for drafter in ("copy", "random", "ngram", "eagle3")
    for overlap in ("off", "on")
] + [("copy", "on", True), ("eagle3", "on", True)]


def prompts_for(seed=3, lengths=(1, 4, 9, 16, 17, 23, 31, 6)):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]
    prompts[1] = [7, 8, 9, 10] * 6  # something for n-gram lookup to find
    return prompts


def make_models(tmp_path_factory) -> dict:
    target = make_tiny_model(tmp_path_factory.mktemp("ov_target"), "llama", num_layers=4)
    other = make_tiny_model(tmp_path_factory.mktemp("ov_draft"), "llama", seed=7, num_layers=1)
    head = make_random_eagle3_head(tmp_path_factory.mktemp("ov_head"), target, 200)
    return {"target": str(target), "copy": str(target), "random": str(other), "eagle3": str(head)}


def spec_kwargs(models, drafter: str | None) -> dict:
    if drafter is None:
        return {}
    if drafter == "ngram":
        return dict(speculative_algorithm="ngram", speculative_policy="fixed")
    algo = "eagle3" if drafter == "eagle3" else "draft"
    return dict(
        speculative_algorithm=algo,
        speculative_draft_model_path=models[drafter],
        speculative_policy="fixed",
    )


def random_draft_lens(llm, seed=11):
    rng = random.Random(seed)
    k_max = llm.engine.spec.k_max
    llm.engine.spec.policy = PerRequestPolicy(k_max, lambda req: rng.choice([0, 0, 1, 2, k_max]))


class StepDraftLens(SpeculationPolicy):
    """One random draft length per step for every request, from `choices` (the goodput
    policy also picks one K per step); the same sequence of steps gets the same lengths."""

    def __init__(self, k_max: int, seed: int, choices=(0, 1, 2, 3)):
        super().__init__(k_max)
        self.rng, self.choices = random.Random(seed), choices

    def choose(self, reqs, load=NO_LOAD):
        k = min(self.rng.choice(self.choices), self.k_max)
        return [k] * len(reqs)


def count_gathers(llm) -> dict:
    """Counts steps prepared while the previous step's tokens were still on the device
    (`gathered`), those of them after a speculative step (`moved`: positions shifted by its
    accept lengths there) and those that drafted (`drafted_ahead`); checks the host's
    bounds on every step: exact lengths once the previous step is resolved, upper bounds
    (its drafts all accepted) within the context and the pages when it is not. Its spies
    stay on until the test ends, as `record_drafts`'s (tests/support/spies.py)."""
    runner, kv = llm.engine.runner, llm.engine.kv
    seen = {"gathered": 0, "steps": 0, "moved": 0, "drafted_ahead": 0}
    prepare = runner.prepare

    def spy(batch, prev=None, *rest):
        seen["steps"] += 1
        seen["gathered"] += prev is not None
        moved = prev is not None and prev.speculative
        seen["moved"] += moved
        seen["drafted_ahead"] += prev is not None and any(s.draft_len for s in batch)
        for s in batch:
            req = s.request
            assert req.num_left > 0  # on the host's estimate: the step in flight counts one
            if prev is None:  # lengths are exact here: a request's last step is its last
                # drafts may pass max_tokens (those tokens are dropped), not the context
                assert req.num_inflight == 0 and s.draft_len < req.max_len - req.committed_len
            ahead = req.num_inflight_drafts if moved else 0  # all of prev's drafts accepted
            assert not ahead or id(req) in prev.rows
            end = req.cached_len + s.num_tokens + ahead + s.draft_len
            assert end <= llm.engine.max_model_len
            assert len(req.page_table) * kv.page_size >= end
        return prepare(batch, prev, *rest)

    spy_on(runner, "prepare", spy)
    sched, schedule = llm.engine.scheduler, llm.engine.scheduler.schedule

    def check(policy=None):
        # On the host's estimate (a speculative step in flight counts one token): a request
        # whose in-flight tokens end it is not scheduled again.
        batch = schedule(policy)
        spec = llm.engine.spec
        lookahead = spec.k_max + 1 if spec else 1
        for s in batch:
            req = s.request
            assert req.num_left > 0
            assert req.cached_len + s.num_tokens + s.draft_len <= llm.engine.max_model_len
            # KV lookahead: at most twice a step's worth past what is committed.
            assert len(req.page_table) <= kv.pages_needed(req.committed_len + 2 * lookahead)
        return batch

    spy_on(sched, "schedule", check)
    return seen


def generate(models, prompts, params, overlap: str, drafter=None, random_k=False, **kw):
    llm = LLM(models["target"], overlap_schedule=overlap, **spec_kwargs(models, drafter), **kw)
    assert llm.engine.loop.overlap == (overlap == "on")
    if random_k:
        random_draft_lens(llm)
    seen = count_gathers(llm)
    outs = llm.generate(prompts, params)
    engine = llm.engine
    assert engine.kv.allocator.num_used == 0 and not engine.has_unfinished()
    assert engine.loop.inflight is None and not engine.requests
    if engine.spec is not None:
        assert engine.spec.acceptance._per_request == {}  # nothing left behind either
    if overlap == "on" and not drafter:
        assert seen["gathered"] > seen["steps"] // 2  # plain steps really ran ahead
    return llm, [(o.token_ids, o.text, o.finish_reason) for o in outs]


def make_reference(models):
    """The synchronous loop without speculation, per parameter set (cached)."""
    cache = {}

    def get(params, prompts=None, **kw):
        key = (repr(params), repr(prompts), repr(sorted(kw.items())))
        if key not in cache:
            cache[key] = generate(models, prompts or prompts_for(), params, "off", **kw)[1]
        return cache[key]

    return get


def stop_params(ref):
    """Stop tokens and stop strings taken from the reference outputs so that they land
    inside the generation (mid-draft under speculation), plus a spread of max_tokens."""
    (t0, _, _), (_, text2, _), (t5, _, _) = ref[0], ref[2], ref[5]
    stop_string = text2[3:6] if len(text2) >= 6 else text2
    return [
        SamplingParams(max_tokens=14, temperature=0.0, stop_token_ids=[t0[4]]),
        SamplingParams(max_tokens=14, temperature=0.0, stop_token_ids=[t5[2], t5[9]]),
        SamplingParams(max_tokens=14, temperature=0.0, stop=[stop_string]),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.0, stop=[stop_string], stop_token_ids=[2]),
        SamplingParams(max_tokens=5, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),  # context limit
    ]


def run_engine(engine, prompts, params) -> dict:
    """Step by hand: each request's tokens and the logprobs its outputs carried."""
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    tokens, logprobs = {}, {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.num_new_tokens == len(out.new_logprobs) or not out.new_logprobs
            logprobs[out.request_id] += [(lp.logprob, lp.top) for lp in out.new_logprobs]
            tokens[out.request_id] = list(out.token_ids)
    assert engine.kv.allocator.num_used == 0
    return [(tokens[rid], logprobs[rid]) for rid in ids]


def record_drafts(llm) -> dict:
    """(prompt index, committed length before the step, draft length) -> drafts, of every
    verify step as processed."""
    loop, drafts = llm.engine.loop, {}
    process, index = loop._process, {}

    def spy(step):
        if step.result is None:
            loop._resolve(step)
        for s in step.step_input.sampled:
            req = s.request
            if s.drafts and not req.finished:
                length = len(req.prompt_token_ids) + len(req.output_token_ids)
                drafts[(index[req.request_id], length, len(s.drafts))] = tuple(s.drafts)
        return process(step)

    spy_on(loop, "_process", spy)
    add = llm.engine.add_request

    def add_spy(prompt, params=None, request_id=None):
        rid = add(prompt, params, request_id)
        index[rid] = len(index)
        return rid

    spy_on(llm.engine, "add_request", add_spy)
    return drafts


def churn(engine, prompts, params, seed=21, arrive_p=0.5, abort_p=0.08):
    """Step `engine` while requests arrive (each step with probability arrive_p, in order)
    and are aborted (a random live one with probability abort_p per step); returns
    (request id -> prompt index, id -> (token_ids, text, finish_reason) of the finished,
    aborted ids, how many aborts hit a request in the step in flight)."""
    rng = random.Random(seed)
    pending = list(range(len(prompts)))
    ids, finished, aborted, in_flight_aborts = {}, {}, set(), 0
    while pending or engine.has_unfinished():
        while pending and rng.random() < arrive_p:
            i = pending.pop(0)
            ids[engine.add_request(prompts[i], params[i])] = i
        for out in engine.step():
            assert out.request_id not in aborted
            if out.finished:
                finished[out.request_id] = (out.token_ids, out.text, out.finish_reason)
        live = [rid for rid in engine.requests if rid not in aborted]
        if live and rng.random() < abort_p:
            victim = rng.choice(live)
            inflight = engine.loop.inflight
            in_flight_aborts += inflight is not None and any(
                s.request.request_id == victim for s in inflight.step_input.sampled
            )
            engine.abort_request(victim)
            aborted.add(victim)
    return ids, finished, aborted, in_flight_aborts
