"""Tensor parallelism's control plane on the CPU (gloo): rank 0's step plans, replayed by the
other ranks on mirrors of its requests (engine/step_plan.py), processes started and stopped
by the engine (engine/tensor_parallel.py), a rank's death as a clear failure."""

from __future__ import annotations

import os
import re
import signal

import pytest

from specserve import SamplingParams
from specserve.core.batch import ScheduledRequest
from specserve.core.errors import TensorParallelError
from specserve.core.request import Request, RequestStatus
from specserve.engine.step_plan import PlanFollower, PlanPublisher, TokenCheck
from tests.support.overlap_cases import prompts_for
from tests.support.spawned import one_intra_op_thread, run_spawned
from tests.support.tiny_models import make_random_eagle3_head, make_tiny_model


class _Wire:
    """A channel that hands each plan over in this process."""

    def __init__(self):
        self.plans = []

    def send(self, plan):
        self.plans.append(plan)

    def recv(self):
        return self.plans.pop(0)


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=8, seed=5), 0, 11, 64, frozenset({2}))


def test_plans_keep_mirrors_of_pages_preemptions_and_departures():
    wire = _Wire()
    publisher, follower = PlanPublisher(wire), PlanFollower(wire)
    a, b = _request("a", [5, 6, 7]), _request("b", [9] * 20)
    a.page_table, b.page_table = [3], [4, 8]
    step = [ScheduledRequest(a, 3), ScheduledRequest(b, 16)]
    publisher.publish(step, [], keeps_drafter=True, waited=False)
    plan = follower.next()
    assert [p.request_id for p in plan.added] == ["a", "b"]  # first scheduled: sent whole
    batch, drafting = follower.batch(plan)
    mirror_a, mirror_b = follower.requests["a"], follower.requests["b"]
    mirror_a.grammar_state, mirror_b.grammar_state = _GrammarState(), _GrammarState()
    assert mirror_a.seed == 11 and mirror_a.params.seed == 5 and mirror_a.detokenizer is None
    assert [(s.request, s.num_tokens) for s in batch] == [(mirror_a, 3), (mirror_b, 16)]
    assert mirror_a.page_table == [3] and mirror_b.page_table == [4, 8] and drafting == []
    assert plan.keeps_drafter and not plan.waited

    # a decodes and drafts into a new page; b is preempted and comes back with new pages,
    # the first of them a prefix cache hit (its drafter's entries valid on half of it)
    a.page_table.append(12)
    mirror_b.cached_len = mirror_b.draft_cached_len = 18
    b.num_preemptions, b.page_table = 1, [20, 21]
    b.cached_len, b.draft_cached_len = 16, 8
    step = [
        ScheduledRequest(a, 1, draft_len=3, decoding=True),
        ScheduledRequest(b, 4),
    ]
    publisher.publish(step, [step[0]], keeps_drafter=False, waited=True)
    plan = follower.next()
    assert plan.added == [] and [r.new_pages for r in plan.rows] == [[12], [20, 21]]
    assert [r.start for r in plan.rows] == [None, (16, 8)]
    batch, drafting = follower.batch(plan)
    assert mirror_a.page_table == [3, 12] and mirror_b.page_table == [20, 21]
    assert mirror_b.num_preemptions == 1  # recomputed past its cached prefix:
    assert (mirror_b.cached_len, mirror_b.draft_cached_len) == (16, 8)
    assert drafting == [batch[0]] and batch[0].draft_len == 3 and batch[0].decoding
    assert plan.waited and not plan.keeps_drafter

    # a's lookahead pages go back under pressure (Scheduler._reclaim_lookahead: 12 lent to
    # another request) and it grows again, into a page 12 was not: the mirror follows
    a.page_table[1:] = [30]
    publisher.publish([ScheduledRequest(a, 1, draft_len=3, decoding=True)], [], False, False)
    plan = follower.next()
    assert [(r.kept, r.new_pages) for r in plan.rows] == [(1, [30])]
    follower.batch(plan)
    assert mirror_a.page_table == a.page_table == [3, 30]
    del a.page_table[1:]  # and only shrinks
    publisher.publish([ScheduledRequest(a, 1, decoding=True)], [], False, False)
    follower.batch(follower.next())
    assert mirror_a.page_table == [3]

    # a leaves on rank 0 (a stop string, an abort): the next plan drops its mirror
    publisher.gone(a)
    publisher.gone(_request("never-scheduled", [1]))  # rank 0 never sent it: nothing to say
    publisher.publish([ScheduledRequest(b, 1, decoding=True)], [], False, False)
    plan = follower.next()
    assert plan.gone == ["a"]
    follower.batch(plan)
    assert "a" not in follower.requests and mirror_a.status is RequestStatus.FINISHED
    assert mirror_a.grammar_state.released == 1  # (this rank's grammar workers' matcher)

    # b ends by its own tokens on this rank first, then rank 0 says it is gone: released once
    follower.finished(mirror_b)
    publisher.gone(b)
    publisher.publish([], [], False, False)
    follower.batch(follower.next())
    assert mirror_b.grammar_state.released == 1
    publisher.stop()
    assert follower.next().stop


def test_a_grammar_reaches_the_ranks_compiled_with_its_first_planned_request():
    """Whichever request brought the grammar compiled to rank 0 (its first one may leave
    before any plan): the first planned one carries it compiled (rank 0's, serialized),
    later ones its key alone, until LOADED_KEPT // 2 other grammars were sent since."""
    from dataclasses import replace

    from specserve.core.sampling_params import Grammar
    from specserve.runtime.grammar import LOADED_KEPT

    serialized = []

    def serialize(grammar):
        serialized.append(grammar.source)
        return f"<{grammar.source}>"

    wire = _Wire()
    publisher = PlanPublisher(wire, serialize)

    def planned(rid, grammar):
        req = _request(rid, [5, 6])
        req.params = replace(req.params, grammar=grammar)
        req.page_table = [3]
        publisher.publish([ScheduledRequest(req, 2)], [], False, False)
        (added,) = wire.recv().added
        assert added.params.grammar == grammar and added.params.seed == 5
        return None if grammar is None else added.params.grammar.compiled

    # its first request left unplanned: the second one arrives without the compiled form
    assert planned("b", Grammar("regex", "a+")) == "<a+>" and serialized == ["a+"]
    assert planned("c", Grammar("regex", "a+")) is None
    assert planned("d", Grammar("regex", "a+", compiled="<a+>")) is None  # (not resent)
    assert planned("e", Grammar("regex", "z+", compiled="<z+>")) == "<z+>"  # (its own)
    for i in range(LOADED_KEPT // 2):
        assert planned(f"f{i}", Grammar("regex", f"b{i}+")) == f"<b{i}+>"
    assert planned("g", Grammar("regex", "a+")) == "<a+>"  # (maybe dropped by the ranks)
    assert planned("h", None) is None


class _GrammarState:
    """A mirror's grammar state (runtime/grammar.py: GrammarState), counting releases."""

    def __init__(self):
        self.released = 0

    def release(self):
        self.released += 1


def test_the_token_check_stops_a_rank_at_its_first_difference():
    check = TokenCheck(rank=1)
    check.remote([(0, [[5, 6]])])  # rank 0's tokens may come first ...
    check.local(0, [[5, 6]])
    check.local(1, [[7], [8, 9]])  # ... or this rank's
    with pytest.raises(TensorParallelError, match=r"step 1: rank 1's tokens \[\[7\], \[8, 9\]\]"):
        check.remote([(1, [[7], [8, 4]])])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = make_tiny_model(tmp_path_factory.mktemp("tp_target"), "llama", num_layers=4)
    head = make_random_eagle3_head(tmp_path_factory.mktemp("tp_head"), target, 200)
    return str(target), str(head)


def _generate_under_tp(target: str, head: str) -> dict:
    """Rank 0 of two (the other rank spawned by the engine), every step's tokens compared
    across the ranks: plain; EAGLE-3 under the goodput policy, then (rank 0's policy swapped:
    the other rank follows its plans) fixed, random per-step and random per-request K, with
    overlap scheduling; EAGLE-3 with the head sharded too (fixed and random per-step K); a
    draft model; n-gram; greedy, and seeded sampling where the draft lengths repeat
    (goodput's follow the clock); with penalties, plain and EAGLE-3 at fixed K (its steps
    launched before the step in flight's tokens are read, which its penalties count before
    sampling, on every rank). Each engine runs the prompts several times: the prefix
    cache's hits start rows past 0 on every rank."""
    from specserve import LLM
    from specserve.core.sampling_params import Grammar
    from specserve.speculative.policy import FixedPolicy
    from tests.support.overlap_cases import StepDraftLens, random_draft_lens

    prompts = prompts_for()
    greedy = SamplingParams(max_tokens=14, ignore_eos=True)
    sampled = [
        SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.9, seed=i)
        for i in range(len(prompts))
    ]
    penalized = SamplingParams(
        max_tokens=14, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5
    )
    constrained = SamplingParams(max_tokens=14, grammar=Grammar("regex", "(ab|c|the ){2,9}"))
    fixed = dict(speculative_policy="fixed")
    engines = {
        "plain": dict(speculative_algorithm="none"),
        "eagle3": dict(
            speculative_algorithm="eagle3",
            speculative_draft_model_path=head,
            speculative_policy="goodput",
            overlap_schedule="on",
        ),
        "eagle3 sharded head": dict(
            speculative_algorithm="eagle3",
            speculative_draft_model_path=head,
            speculative_head_parallel="sharded",
            overlap_schedule="on",
            **fixed,
        ),
        "draft model": dict(
            speculative_algorithm="draft", speculative_draft_model_path=target, **fixed
        ),
        # a cache small enough that lookahead pages go back under pressure (reclaimed)
        "draft model small cache": dict(
            speculative_algorithm="draft",
            speculative_draft_model_path=target,
            page_size=4,
            num_kv_pages=40,
            **fixed,
        ),
        "ngram": dict(speculative_algorithm="ngram", **fixed),
    }
    policies = {  # rank 0's policy for each run (None: the engine's own)
        "plain": [None],
        "eagle3": [None, "fixed", "per step", "per request"],
        "eagle3 sharded head": [None, "per step"],
        "draft model": [None],
        "draft model small cache": [None],
        "ngram": ["per request"],
    }
    out = {}
    # (a small step: the goodput policy's start-up times every step size under TP)
    tp = dict(
        tensor_parallel_size=2, debug_tp_check=True, max_num_batched_tokens=256, max_num_seqs=8
    )
    for engine, kwargs in engines.items():
        with LLM(target, **tp, **kwargs) as llm:
            spec, scheduler = llm.engine.spec, llm.engine.scheduler
            reclaim, reclaimed = scheduler._reclaim_lookahead, []

            def spy(batch, reclaim=reclaim, reclaimed=reclaimed):
                reclaimed.append(reclaim(batch))
                return reclaimed[-1]

            scheduler._reclaim_lookahead = spy
            for policy in policies[engine]:

                def run(params, policy=policy, spec=spec, llm=llm):
                    if policy == "fixed":
                        spec.policy = FixedPolicy(spec.k_max)
                    elif policy == "per step":
                        spec.policy = StepDraftLens(spec.k_max, seed=5)
                    elif policy == "per request":
                        random_draft_lens(llm)
                    return [o.token_ids for o in llm.generate(prompts, params)]

                name = f"{engine} {policy or ''}".strip()
                out[name] = run(greedy)
                if engine != "plain" and spec.policy.__class__.__name__ != "GoodputPolicy":
                    out[name + " sampled"] = run(sampled) == run(sampled)
                if name in ("plain", "eagle3 fixed"):
                    out[name + " penalized"] = run(penalized)
                    # the grammar's first request leaves before any plan carries it
                    llm.engine.abort_request(llm.engine.add_request(prompts[0], constrained))
                    out[name + " constrained"] = [
                        o.text for o in llm.generate(prompts, constrained)
                    ]
                    waits = llm.engine.stats()["loop_wait_reasons"]
                    out[name + " late"] = waits.get("penalties_before_sampling", 0)
            out.setdefault("reclaims", {})[engine] = sum(reclaimed)
            # runs after the first find their prompts' pages cached (rows start past 0)
            out.setdefault("prefix hits", {})[engine] = llm.engine.stats()[
                "prefix_cache_hit_tokens"
            ]
    return out


def test_speculation_under_tensor_parallelism_equals_its_plain_decoding(models):
    status, out = run_spawned(_generate_under_tp, *models)
    assert status == "ok", out
    assert all(len(t) == 14 for t in out["plain"])
    assert out.pop("reclaims")["draft model small cache"] > 0  # lookahead pages went back
    hits = out.pop("prefix hits")
    assert all(hits[engine] > 0 for engine in hits if engine != "plain"), hits  # (one run)
    assert out.pop("eagle3 fixed late") > 0, "no step read the step in flight before sampling"
    out.pop("plain late")
    assert out.pop("eagle3 fixed penalized") == out.pop("plain penalized")
    # structured output: the ranks' masks agree (--debug-tp-check), drafts change nothing
    constrained = out.pop("plain constrained")
    assert out.pop("eagle3 fixed constrained") == constrained
    language_prefix = "(ab|c|the )*(a|t|th|the)?"  # (max_tokens may cut a word)
    assert all(re.fullmatch(language_prefix, text) for text in constrained), constrained
    names = [n for n in out if n != "plain" and not n.endswith("sampled")]
    assert len(names) == 9 and sum(n.endswith("sampled") for n in out) == 8
    for name in names:
        assert out[name] == out["plain"], name
        assert out.get(name + " sampled", True), f"{name}: seeded sampling not reproducible"


def _lose_a_rank(target: str) -> None:
    from specserve import LLM

    llm = LLM(target, tensor_parallel_size=2, speculative_algorithm="none")
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    os.kill(llm.engine.parallel.processes[0].pid, signal.SIGKILL)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=64))  # waits for the dead rank


def test_a_dead_rank_stops_rank_0_instead_of_hanging(models):
    # rank 0 exits (its watcher: "tensor-parallel rank 1 ... was killed by SIGKILL"), or on
    # the CPU its step's collective fails first when the dead rank's connection closes,
    # said naming the rank; never a hang
    status, detail = run_spawned(_lose_a_rank, models[0], timeout_s=120)
    assert (status, detail) == ("exit", 1) or (
        status == "error"
        and detail.startswith("TensorParallelError: tensor-parallel rank 1 (process ")
        and "was killed by SIGKILL (out of memory?); this engine cannot go on" in detail
    ), detail


def _machine(target: str, node_rank: int, nnodes: int, address: str | None) -> list | None:
    """One machine of a two-rank group: machine 0 generates (rank 0), machine 1 follows."""
    from specserve import LLM
    from specserve.core.config import EngineConfig
    from specserve.engine.engine import LLMEngine

    flags = dict(
        model=target,
        tensor_parallel_size=2,
        nnodes=nnodes,
        node_rank=node_rank,
        dist_init_addr=address,
        debug_tp_check=True,
        speculative_algorithm="ngram",
        speculative_policy="fixed",
    )
    if node_rank > 0:
        LLMEngine(EngineConfig.from_flags(**flags)).follow()
        return None
    with LLM(**flags) as llm:
        greedy = SamplingParams(max_tokens=12, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompts_for(), greedy)]


def test_two_machines_over_loopback_run_as_one(models):
    import multiprocessing as mp

    from specserve import LLM
    from specserve.engine.tensor_parallel import free_address

    # one rank's plain decoding (two ranks on one machine give its tokens: the test above)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = LLM(models[0], speculative_algorithm="none")
    one = [o.token_ids for o in plain.generate(prompts_for(), greedy)]
    address = free_address()
    machine_1 = mp.get_context("spawn").Process(
        target=_machine, args=(models[0], 1, 2, address), daemon=True
    )
    with one_intra_op_thread():
        machine_1.start()
    status, two = run_spawned(_machine, models[0], 0, 2, address)
    machine_1.join(timeout=60)
    assert status == "ok", two
    assert machine_1.exitcode == 0  # stopped by rank 0, not killed
    assert two == one


def test_one_rank_starts_no_process_group(models):
    """--tp 1 (the default) joins no group: no NCCL or gloo, every collective a no-op."""
    import torch.distributed as dist

    from specserve import LLM

    llm = LLM(models[0], speculative_algorithm="none")
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    assert llm.engine.parallel is None and not dist.is_initialized()
    assert llm.engine.runner.model.tp.size == 1


def test_a_shape_the_ranks_cannot_split_is_refused_before_any_rank_starts(models, tmp_path):
    """One line naming what does not split, from the first rank before it spawns the others
    (no rank's traceback first); a sharded EAGLE-3 head is checked as the target is."""
    import json
    import multiprocessing
    import shutil

    from specserve import LLM
    from specserve.core.config import EngineConfig
    from specserve.core.errors import ConfigError
    from specserve.engine.tensor_parallel import check_shapes

    with pytest.raises(ConfigError) as e:
        LLM(models[0], tensor_parallel_size=3, speculative_algorithm="none")
    assert str(e.value).startswith(
        "the model cannot be split over 3 ranks: num_heads 4 is not divisible by "
        "tensor_parallel_size 3"
    )
    assert multiprocessing.active_children() == []

    head = shutil.copytree(models[1], tmp_path / "head")
    raw = json.loads((head / "config.json").read_text())
    raw["intermediate_size"] = 91
    (head / "config.json").write_text(json.dumps(raw))
    flags = dict(
        model=models[0],
        tensor_parallel_size=2,
        speculative_algorithm="eagle3",
        speculative_draft_model_path=str(head),
    )
    check_shapes(EngineConfig.from_flags(**flags))  # replicated: every rank holds it whole
    with pytest.raises(
        ConfigError,
        match="the EAGLE-3 head cannot be split over 2 ranks: "
        "intermediate_size 91 is not divisible",
    ):
        check_shapes(EngineConfig.from_flags(**flags, speculative_head_parallel="sharded"))
