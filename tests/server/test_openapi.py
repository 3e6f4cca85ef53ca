"""The OpenAPI document describes the server as it behaves (400s, not FastAPI's 422s; the
completions' bodies and event streams; /metrics as text; /health's 503; the bearer key), and
schemathesis, driving the live server from that document, finds no response outside it."""

from __future__ import annotations

import itertools

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)


@pytest.fixture(scope="module")
def document(server) -> dict:
    return httpx.get(server.url + "/openapi.json", headers=server.headers, timeout=10).json()


def test_the_document_says_what_the_server_answers(document):
    assert "422" not in str(document["paths"])
    assert "HTTPValidationError" not in document["components"]["schemas"]
    for name in ("completions", "chat/completions"):
        responses = document["paths"][f"/v1/{name}"]["post"]["responses"]
        assert {"200", "400", "401", "413", "415", "429", "503"} <= set(responses)
        content = responses["200"]["content"]
        assert "text/event-stream" in content and "$ref" in str(content["application/json"])
    ok = document["paths"]["/v1/completions"]["post"]["responses"]["200"]
    assert ok["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionResponse")
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]
    assert chat["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionResponse")
    assert "ChatCompletionChunk" in chat["description"]
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    assert "503" in document["paths"]["/health"]["get"]["responses"]
    # the key: every operation but /health needs it
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    secured = {
        path
        for path, item in document["paths"].items()
        if all("security" in op for op in item.values())
    }
    assert secured == set(document["paths"]) - {"/health"}


def test_responses_meet_the_document(server):
    """Generated requests, valid and invalid, for every operation against the live server: never a
    5xx, every status, content type and JSON body as documented. (schemathesis's own pytest
    plugin does not run under this pytest: its Python API, with hypothesis, does the same.)"""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=server.headers)
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 6

    runs = [
        (op, mode)
        for op, mode in itertools.product(operations, GenerationMode)
        if mode is GenerationMode.POSITIVE or op.method.upper() == "POST"
    ]
    for operation, mode in runs:
        _fuzz(operation, mode, server.headers, checks)
    # Generated bodies seldom make it to a 200: the documented successes, whole and streamed,
    # each checked too.
    by_path = {op.path: op for op in operations}
    for path, body in SUCCESSES:
        case = by_path[path].Case(body=body, media_type="application/json")
        response = case.call_and_validate(headers=server.headers, checks=checks)
        assert response.status_code == 200, response.text


SUCCESSES = [
    ("/v1/completions", {"prompt": "The quick", "max_tokens": 3}),
    ("/v1/completions", {"prompt": [[5, 6], [7]], "max_tokens": 2, "n": 2, "logprobs": 2}),
    # echoed, the prompt's first token has no logprob: null (found by the fuzzing above)
    ("/v1/completions", {"prompt": "The quick", "max_tokens": 2, "logprobs": 2, "echo": True}),
    (
        "/v1/completions",
        {
            "prompt": "The quick",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
]


def _fuzz(operation, mode: GenerationMode, headers: dict, checks: list) -> None:
    """One operation's generated requests in one generation mode (a few examples each)."""

    @given(case=operation.as_strategy(mode))
    @settings(
        max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    def check(case):
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            # keep generation cheap on a CPU (n up to 128, max_tokens up to the context)
            case.body = {**case.body, "max_tokens": 2, "max_completion_tokens": 2}
        case.call_and_validate(headers=headers, checks=checks)

    check()
