"""Bad input always gets an OpenAI-style 4xx naming the field, never a 5xx; a fuzz test
throws malformed requests at the server and checks it stays healthy."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CMPL = {"model": "tinyllama", "prompt": "The quick", "max_tokens": 2}
CHAT = {"model": "tinyllama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (endpoint, body changes, expected status, expected param)
CASES = [
    ("completions", {"temperature": -1}, 400, "temperature"),
    ("completions", {"temperature": "hot"}, 400, "temperature"),
    ("completions", {"top_p": 0}, 400, "top_p"),
    ("completions", {"top_k": -5}, 400, "top_k"),
    ("completions", {"min_p": 1.5}, 400, "min_p"),
    ("completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"max_tokens": 100000}, 400, "max_tokens"),
    ("completions", {"n": 0}, 400, "n"),
    ("completions", {"n": 1000}, 400, "n"),
    ("completions", {"logprobs": 21}, 400, "logprobs"),
    ("completions", {"seed": "x"}, 400, "seed"),
    ("completions", {"seed": 2**70}, 400, "seed"),
    ("completions", {"stop": ""}, 400, "stop"),
    ("completions", {"stop": [1, 2]}, 400, "stop[0]"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("completions", {"prompt": [-1]}, 400, "prompt[0]"),
    ("completions", {"prompt": ["hi", ""]}, 400, "prompt[1]"),
    ("completions", {"prompt": [[5, 6], [99999]]}, 400, "prompt[1]"),
    ("completions", {"prompt": None}, 400, "prompt"),
    ("completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("completions", {"stream": "yes please"}, 400, "stream"),
    ("completions", {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"max_tokens": 0, "echo": True, "logprobs": 21}, 400, "logprobs"),
    ("completions", {"best_of": 3}, 400, "best_of"),
    ("completions", {"presence_penalty": 2.5}, 400, "presence_penalty"),
    ("completions", {"frequency_penalty": -3}, 400, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"logit_bias": {"five": 1.0}}, 400, "logit_bias"),
    ("completions", {"logit_bias": {"²": 1.0}}, 400, "logit_bias"),
    ("completions", {"logit_bias": {"5": 500}}, 400, "logit_bias.5"),
    ("completions", {"logit_bias": {"99999": 1.0}}, 400, "logit_bias"),
    ("completions", {"min_tokens": 5}, 400, "min_tokens"),
    ("completions", {"min_tokens": -1}, 400, "min_tokens"),
    ("completions", {"model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    (
        "chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
    ),
    (
        "chat/completions",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        400,
        "messages[0].content[0].type",
    ),
    # (OpenAI's rules for messages: they were served with the missing parts empty)
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]},
        400,
        "messages[1].content",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "tool", "content": "noon", "tool_call_id": "c1"}]},
        400,
        "messages[0].role",
    ),
    (
        "chat/completions",
        {
            "messages": [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "content": "noon"},
            ]
        },
        400,
        "messages[2].tool_call_id",
    ),
    ("chat/completions", {"max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ("chat/completions", {"max_completion_tokens": 100000}, 400, "max_completion_tokens"),
    ("chat/completions", {"top_logprobs": 3}, 400, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("chat/completions", {"tools": [{"type": "function"}]}, 400, "tools[0].function"),
    # the tiny model's template renders no tools
    (
        "chat/completions",
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
    ),
    ("chat/completions", {"tool_choice": "required"}, 400, "tool_choice"),
    ("chat/completions", {"response_format": {"type": "yaml"}}, 400, "response_format.type"),
    (
        "completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
        400,
        "response_format.json_schema.schema",
    ),
    (
        "chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        400,
        "response_format",
    ),
    ("chat/completions", {"model": "nope"}, 404, "model"),
    # a text part whose text is no string: the part's text is named (was a 500)
    *(
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
            400,
            "messages[0].content[0].text",
        )
        for text in (5, None, True, ["a"], {"a": 1})
    ),
    # token ids checked against the vocabulary before any stream starts
    ("completions", {"logit_bias": {"99999": 1.0}, "stream": True}, 400, "logit_bias"),
    ("completions", {"logit_bias": {"384": 1.0}, "stream": True}, 400, "logit_bias"),
    ("completions", {"logit_bias": {"5": 1.0, "005": 2.0}}, 400, "logit_bias"),
    ("completions", {"logit_bias": {"9" * 4400: 1.0}}, 400, "logit_bias"),
    ("completions", {"stop_token_ids": [99999], "stream": True}, 400, "stop_token_ids"),
    ("completions", {"prompt": ["a"] * 1025}, 400, "prompt"),
    (
        "completions",
        {"response_format": {"type": "json_object"}, "ignore_eos": True},
        400,
        "ignore_eos",
    ),  # fmt: skip
    # defined by the API, not implemented: refused unless neutral
    ("chat/completions", {"modalities": ["text", "audio"]}, 400, "modalities"),
    ("chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
    ("chat/completions", {"functions": [{"name": "f"}]}, 400, "functions"),
    ("chat/completions", {"function_call": "auto"}, 400, "function_call"),
    ("chat/completions", {"reasoning_effort": "high"}, 400, "reasoning_effort"),
    ("chat/completions", {"best_of": 3}, 400, "best_of"),
    ("chat/completions", {"echo": True}, 400, "echo"),
]


def _post(server, endpoint, body=None, content=None):
    return httpx.post(
        f"{server.url}/v1/{endpoint}",
        json=body,
        content=content,
        headers=server.headers,
        timeout=60,
    )


def _assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if status == 400:
        assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("endpoint,change,status,param", CASES)
def test_bad_field_is_named(server, endpoint, change, status, param):
    body = {**(CMPL if endpoint == "completions" else CHAT), **change}
    _assert_error(_post(server, endpoint, body), status, param)


def test_prompt_too_long_states_the_limit(server):
    r = _post(server, "completions", {**CMPL, "prompt": list(range(3, 300)) * 2})
    _assert_error(r, 400, "prompt")
    assert "512" in r.json()["error"]["message"]
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "fox " * 2000}]}
    r = _post(server, "chat/completions", long_chat)
    _assert_error(r, 400, "messages")
    assert "512" in r.json()["error"]["message"]


def test_nulls_are_the_defaults(server):
    """Every nullable field sent as null means its default (clients and proxies send unset
    fields as null): one choice, no stream, completions' 16 tokens."""
    nulls = {"n": None, "stream": None, "ignore_eos": None, "temperature": None, "stop": None}
    chat = {**CHAT, **nulls, "logprobs": None, "top_logprobs": None, "max_tokens": 3}
    r = _post(server, "chat/completions", chat)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    body = {**CMPL, **nulls, "max_tokens": None, "echo": None, "logprobs": None}
    r = _post(server, "completions", {**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16  # (completions' default)
    assert not r.json()["choices"][0]["text"].startswith(CMPL["prompt"])  # (no echo)
    _assert_error(_post(server, "completions", {**CMPL, "prompt": None}), 400, "prompt")


def test_neutral_values_of_unimplemented_fields_pass(server):
    body = {**CHAT, "modalities": ["text"], "best_of": 1, "echo": False, "functions": []}
    body["function_call"] = "none"
    assert _post(server, "chat/completions", body).status_code == 200


def test_a_prompt_far_past_the_context_is_refused_without_encoding_it(server):
    """A text that cannot fit by its size alone (at least bytes / the longest token's bytes
    tokens) is a 400 saying so, not minutes of tokenizing: 3 MB on every endpoint form."""
    text = "fox " * 750_000
    for endpoint, body in (
        ("completions", {**CMPL, "prompt": text}),
        ("completions", {**CMPL, "prompt": ["hi", text]}),
        ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": text}]}),
    ):
        r = _post(server, endpoint, body)
        _assert_error(r, 400)
        message = r.json()["error"]["message"]
        assert "at least" in message and "512" in message, message
    assert r.json()["error"]["param"] == "messages"


def test_schemas_the_grammar_would_not_enforce_are_400s_naming_the_field(server):
    """A pattern xgrammar would match as raw JSON text, a keyword it would drop, a schema
    that allows no value, one nested past MAX_SCHEMA_DEPTH (from ~480 levels, a 500:
    json.dumps recursed on the event loop): each a 400 naming response_format that says
    what to change."""
    chat = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
    chat += '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '
    deep = '{"type": "object", "properties": {"a": ' * 300 + '{"type": "integer"}' + "}}" * 300
    for schema, says in (
        ('{"type": "string", "pattern": "^a\\"b$"}', "pattern"),
        ('{"type": "string", "pattern": "^a+$", "maxLength": 2}', "put the length in"),
        ('{"anyOf": []}', "an empty anyOf"),
        ('{"type": "integer", "enum": ["a"]}', "an enum none of whose values"),
        (deep, "nested too deeply"),
    ):
        r = _post(server, "chat/completions", content=(chat + schema + "}}}").encode())
        _assert_error(r, 400, "response_format")
        assert says in r.json()["error"]["message"], r.text


def test_malformed_bodies(server):
    _assert_error(_post(server, "completions", content=b"{not json"), 400)
    _assert_error(_post(server, "completions", content=b"[1, 2]"), 400)
    _assert_error(_post(server, "completions", content=b"\xff\xfe"), 400)
    for body in (b'{"prompt": "\xff"}', b"[" * 2000 + b"]" * 2000, b'{"n": ' + b"9" * 5000 + b"}"):
        r = _post(server, "completions", content=body)
        _assert_error(r, 400)
        assert r.json()["error"]["message"].startswith("the body"), r.text
    _assert_error(_post(server, "completions", {"model": "tinyllama"}), 400, "prompt")
    r = httpx.get(f"{server.url}/v1/nothing", headers=server.headers)
    _assert_error(r, 404)
    r = httpx.get(f"{server.url}/v1/completions", headers=server.headers)
    _assert_error(r, 405)


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
_FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "modalities",
    "audio",
    "functions",
    "function_call",
    "reasoning_effort",
]


@st.composite
def _mutated(draw):
    endpoint = draw(st.sampled_from(["completions", "chat/completions"]))
    body = dict(CMPL if endpoint == "completions" else CHAT)
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(_FIELDS))
        if draw(st.booleans()) and field in body:
            del body[field]
        else:
            body[field] = draw(_json_values)
    # Valid but long generations only slow the fuzz down.
    body.setdefault("max_tokens", 2)
    for field, cap in (("max_tokens", 8), ("max_completion_tokens", 8), ("n", 2)):
        value = body.get(field)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
            body[field] = cap
    return endpoint, body


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(case=_mutated())
def test_fuzz_never_5xx(server, case):
    endpoint, body = case
    r = _post(server, endpoint, content=json.dumps(body).encode())
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        _assert_error(r, r.status_code)
    assert httpx.get(server.url + "/health").status_code == 200
