"""`Request.max_useful_drafts` is stored, not computed: the scheduler sets it for each decoding
request it hands the policy. Whenever a policy reads it, it equals max(0, num_left - 1) of
that moment, through token commits, max_tokens, stop tokens and strings, the context limit,
preemption, aborts (in flight too) and draft lengths that change every step, in the
synchronous and the overlapped loop."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.core.request import Request
from specserve.speculative.policy import NO_LOAD
from tests.support.overlap_cases import (
    StepDraftLens,
    churn,
    make_models,
    make_reference,
    prompts_for,
    spec_kwargs,
    stop_params,
)


class CapCheck(StepDraftLens):
    """Random K per step; records (stored cap, computed cap) of every request it is given."""

    def __init__(self, k_max: int, seed: int):
        super().__init__(k_max, seed)
        self.seen: list[tuple[int, int]] = []

    def choose(self, reqs, load=NO_LOAD):
        self.seen += [(r.max_useful_drafts, max(0, r.num_left - 1)) for r in reqs]
        return self._decided(super().choose(reqs, load))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


def test_new_request_cap():
    for max_tokens, max_len, want in ((5, 100, 4), (50, 12, 1), (1, 100, 0), (3, 10, 0)):
        req = Request(
            "r",
            list(range(10)),
            SamplingParams(max_tokens=max_tokens),
            arrival=0,
            seed=0,
            max_len=max_len,
            eos_token_ids=frozenset(),
        )
        assert req.max_useful_drafts == want == max(0, req.num_left - 1)


@pytest.mark.parametrize("overlap, drafter", [("off", "random"), ("on", "eagle3")])
def test_stored_cap_equals_computed_whenever_read(models, overlap, drafter):
    prompts = prompts_for(seed=8, lengths=(3, 12, 7, 20, 5, 16, 9, 2, 14, 6, 31, 23))
    params = stop_params(
        make_reference(models)(SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
    )
    params = [params[i % len(params)] for i in range(len(prompts))]
    llm = LLM(
        models["target"],
        overlap_schedule=overlap,
        page_size=4,
        num_kv_pages=20,
        speculative_num_steps=3,
        **spec_kwargs(models, drafter),
    )
    policy = llm.engine.spec.policy = CapCheck(3, seed=5)
    engine = llm.engine
    _, finished, aborted, _ = churn(engine, prompts, params, arrive_p=0.6, abort_p=0.05)
    assert policy.seen and all(stored == computed for stored, computed in policy.seen)
    # Not vacuous: caps below K_max were read (max_tokens and the context limit near), the
    # cache forced preemptions, requests were aborted and hit each kind of finish.
    assert {c for _, c in policy.seen} >= {0, 1, 2, 3}
    assert engine.scheduler.num_preemptions > 0 and aborted
    assert {reason for _, _, reason in finished.values()} == {"stop", "length"}
