"""The server speculating: greedy output equals plain offline decoding, speculation shows in
/metrics, and simulated acceptance marks every response."""

from __future__ import annotations

import json

import openai
import pytest

from specserve import LLM, SamplingParams
from specserve.server.openai_format import SIMULATED_FINGERPRINT
from tests.server.conftest import ServerProcess

PROMPTS = ["The quick brown fox", "Paged attention stores keys", "Héllo wörld"]


@pytest.fixture(scope="module")
def spec_server(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    srv = ServerProcess(
        tiny_llama,
        folder,
        "--speculative-trace-file",
        str(folder / "trace.json"),
        "--speculative-algorithm",
        "draft",
        "--speculative-draft-model-path",
        str(tiny_llama),
        "--speculative-num-steps",
        "3",
        "--speculative-policy",
        "fixed",
    )
    yield srv
    srv.stop()


def test_speculating_server_is_lossless_and_reports(spec_server, tiny_llama):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none", max_retries=0)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = [
        o.text for o in LLM(str(tiny_llama), speculative_algorithm="none").generate(PROMPTS, params)
    ]
    for prompt, text in zip(PROMPTS, expected):
        out = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompt,
            max_tokens=20,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == text
        assert out.system_fingerprint is None
    m = spec_server.metrics()
    assert m["specserve_spec_draft_tokens_total"] > 0
    # A copy of the target as drafter: every draft is accepted.
    assert m["specserve_spec_accepted_tokens_total"] == m["specserve_spec_draft_tokens_total"]
    assert m['specserve_spec_draft_length_steps_total{draft_len="3"}'] > 0
    assert m['specserve_spec_step_k_steps_total{k="3"}'] > 0
    # K=3 steps' periods: as many timed as there were, each taking some time; the draft
    # model drafts eagerly, a pass for each step's catch-up and each further draft
    timed = m['specserve_spec_timed_steps_total{k="3"}']
    assert 0 < timed <= m['specserve_spec_step_k_steps_total{k="3"}']
    assert m['specserve_spec_step_period_seconds_total{k="3"}'] > 0
    assert m["specserve_spec_drafter_eager_passes_total"] >= 3 * timed
    assert (
        m["specserve_spec_drafter_eager_tokens_total"]
        >= m["specserve_spec_drafter_eager_passes_total"]
    )


def test_the_policy_trace_is_written_when_the_server_stops(spec_server):
    """(After the test above: its requests' steps are in the trace.)"""
    steps = spec_server.metrics()['specserve_spec_step_k_steps_total{k="3"}']
    assert spec_server.terminate() == 0
    record = json.loads((spec_server.log_path.parent / "trace.json").read_text())
    assert record["stats"]["spec_policy"] == "FixedPolicy"
    decisions = record["decisions"]
    assert len(decisions) >= steps > 0 and 3 in {d["k"] for d in decisions}
    assert any(d["observed_ms"] for d in decisions)


def test_simulated_acceptance_marks_every_response(tiny_llama, tmp_path):
    srv = ServerProcess(
        tiny_llama,
        tmp_path,
        "--speculative-algorithm",
        "ngram",
        "--speculative-policy",
        "fixed",
        "--speculative-simulate-acceptance",
        "0.5",
    )
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="a b a b a b", max_tokens=8)
        assert out.system_fingerprint == SIMULATED_FINGERPRINT
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert chat.system_fingerprint == SIMULATED_FINGERPRINT
        chunks = list(
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
            )
        )
        assert chunks and all(c.system_fingerprint == SIMULATED_FINGERPRINT for c in chunks)
        assert srv.metrics()["specserve_engine_spec_simulated_acceptance"] == 1
        assert "SIMULATED ACCEPTANCE" in srv.log()
    finally:
        srv.stop()
