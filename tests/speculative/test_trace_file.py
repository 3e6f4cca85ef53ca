"""`--speculative-trace-file`: the engine writes the goodput policy's recent decisions and
its tables as JSON when it stops, each decision with what the step turned out to cost."""

from __future__ import annotations

import json
import random

import pytest

from specserve import LLM, SamplingParams
from specserve.core.config import EngineConfig
from specserve.core.errors import ConfigError
from tests.support.tiny_models import VOCAB, make_random_eagle3_head, make_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = make_tiny_model(tmp_path_factory.mktemp("t"), "llama", num_layers=4)
    head = make_random_eagle3_head(tmp_path_factory.mktemp("h"), target, 300)
    return str(target), str(head)


def test_the_trace_file_holds_each_step_decision_and_what_it_cost(models, tmp_path):
    target, head = models
    path = tmp_path / "trace.json"
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 9, 14)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(
        target,
        speculative_algorithm="eagle3",
        speculative_draft_model_path=head,
        speculative_trace_file=str(path),
    ) as llm:
        llm.generate(prompts, params)
        steps = llm.engine.stats()["spec_steps_by_step_k"]
        assert not path.exists()  # (written when the engine stops)
    record = json.loads(path.read_text())
    assert record["stats"]["spec_policy"] == "GoodputPolicy"
    decisions = record["decisions"]
    assert len(decisions) == sum(steps) and decisions[0]["step"] == 1
    timed = [d for d in decisions if d["observed_ms"] is not None]
    assert timed and all(d["observed_ms"] > 0 for d in timed)
    assert {d["parts"] for d in timed} <= {"awake", "prefill", "dormant", "dormant+prefill"}
    deliberated = [d for d in decisions if d["period_ms"] is not None]
    assert deliberated and all(len(d["tokens"]) == len(d["period_ms"]) for d in deliberated)
    assert all(d["tokens"] is not None for d in decisions if d["held"])


def test_a_trace_file_in_a_missing_folder_is_refused_at_start(tmp_path):
    with pytest.raises(ConfigError, match="speculative_trace_file.*does not exist"):
        EngineConfig.from_flags(
            model="unused", speculative_trace_file=str(tmp_path / "nowhere" / "t.json")
        )
