"""The drafts the grammar masks follow are copied to the host when the step is packed
(runtime/grammar.py: copy_drafts), not read back after its forward: every step that carries
a constrained request's drafts starts that copy, with exactly those drafts in order, and a
step of unconstrained requests starts none (no work per step without a grammar)."""

from __future__ import annotations

import pytest

from specserve import LLM, Grammar, SamplingParams
from specserve.runtime.grammar import _constrained_spans
from tests.support.overlap_cases import make_models, prompts_for, spec_kwargs
from tests.support.spies import spy_on


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


def _spy(llm) -> list[tuple[object, list[int]]]:
    """(the step's grammar_drafts, the drafts its constrained requests carry) of each step."""
    runner, seen = llm.engine.runner, []
    prepare = runner.prepare

    def spy(*args):
        step = prepare(*args)
        _, rows = _constrained_spans(step)
        seen.append((step.grammar_drafts, step.input_ids[rows].tolist() if rows else []))
        return step

    spy_on(runner, "prepare", spy)
    return seen


@pytest.mark.parametrize(("drafter", "overlap"), [("copy", "off"), ("eagle3", "on")])
def test_constrained_drafts_are_copied_when_the_step_is_packed(models, drafter, overlap):
    llm = LLM(models["target"], overlap_schedule=overlap, **spec_kwargs(models, drafter))
    seen = _spy(llm)
    prompts = prompts_for()
    json_half = [
        SamplingParams(max_tokens=12, grammar=Grammar("json") if i % 2 else None)
        for i in range(len(prompts))
    ]
    llm.generate(prompts, json_half)
    with_drafts = [(copied, drafts) for copied, drafts in seen if drafts]
    assert with_drafts  # constrained requests drafted
    for copied, drafts in with_drafts:
        assert copied.host.tolist() == drafts
    seen.clear()
    llm.generate(prompts, SamplingParams(max_tokens=12))  # no grammar: nothing copied
    assert seen and all(copied is None for copied, _ in seen)
