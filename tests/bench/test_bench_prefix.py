"""Workloads for a prefix cache: a shared prefix on every prompt, multi-turn conversations
that resend the server's own answers, and the report's cached-token figures. A stub server
(raw ASGI) records every request body and answers each with text of its own numbering."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import uvicorn

from specserve.bench.conversations import Conversation, multi_turn_dataset
from specserve.bench.datasets import BenchPrompt, DatasetError, build_dataset, jsonl_dataset
from specserve.bench.load import (
    NOT_SENT,
    LoadConfig,
    RequestResult,
    client_session,
    request_body,
    send_request,
)
from specserve.bench.report import report_rows, summarize
from specserve.bench.runner import benchmark
from specserve.bench.server_process import free_port
from specserve.bench.sweep import warm_up
from specserve.cli import main
from specserve.model.loader import load_tokenizer, resolve_model


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class ChatStub:
    """Answers /v1/completions and /v1/chat/completions with "answer N." (N: the request's
    number, streamed in two chunks) and records (body, answer). Usage: under chat, a turn t
    request (t earlier user messages) reports 100 * (t + 1) prompt tokens of which 100 * t
    cached (`cached`: "present"; "null": prompt_tokens_details null; "absent": no details).
    Turns at `fail_turn` or later get HTTP 500."""

    def __init__(self):
        self.reset()

    def reset(self, cached: str = "present", fail_turn: int | None = None) -> None:
        self.cached, self.fail_turn = cached, fail_turn
        self.requests: list[tuple[dict, str]] = []
        self.in_flight = self.max_in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        chat = scope["path"] == "/v1/chat/completions"
        if not chat and scope["path"] != "/v1/completions":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"not found"})
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = json.loads(raw)
        turn = sum(m["role"] == "user" for m in body["messages"]) - 1 if chat else 0
        if self.fail_turn is not None and turn >= self.fail_turn:
            await send({"type": "http.response.start", "status": 500, "headers": []})
            await send({"type": "http.response.body", "body": b"failed on purpose"})
            return
        answer = f"answer {len(self.requests)}."
        self.requests.append((body, answer))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        start = {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
        await send(start)
        for text in (answer[:7], answer[7:]):
            choice = {"index": 0, "delta": {"content": text}} if chat else {"text": text}
            chunk = _sse({"choices": [choice], "usage": None})
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(0.005)  # other conversations' requests overlap this one
        usage = {"prompt_tokens": 100 * (turn + 1), "completion_tokens": 2}
        if self.cached == "present":
            usage["prompt_tokens_details"] = {"cached_tokens": 100 * turn}
        elif self.cached == "null":
            usage["prompt_tokens_details"] = None
        self.in_flight -= 1
        final = _sse({"choices": [], "usage": usage}) + b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": final, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture(scope="module")
def stub():
    app = ChatStub()
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    app.url = f"http://127.0.0.1:{port}"
    yield app
    server.should_exit = True
    thread.join(10)


def test_shared_prefix_starts_every_prompt_with_exact_tokens(tiny_llama):
    tok = load_tokenizer(resolve_model(str(tiny_llama)))
    args = dict(
        kind="random",
        n=5,
        input_len=12,
        output_len=4,
        range_ratio=0.5,
        path=None,
        tokenizer=tok,
        seed=7,
    )
    ds = build_dataset(**args, shared_prefix_len=24)
    prefix = ds.prompts[0].prefix
    assert len(tok.encode(prefix, add_special_tokens=False)) == 24
    assert all(p.prefix == prefix for p in ds.prompts) and ds.shared_prefix_len == 24
    # after the prefix: the prompts the dataset has without one, each different
    plain = build_dataset(**args)
    assert [p.prompt for p in ds.prompts] == [p.prompt for p in plain.prompts]
    texts = [request_body(LoadConfig("http://x"), p)["prompt"] for p in ds.prompts]
    assert all(t.startswith(prefix + "\n\n") for t in texts)
    assert len({t[len(prefix) :] for t in texts}) == 5
    chat = request_body(LoadConfig("http://x", endpoint="chat"), ds.prompts[1])["messages"]
    assert chat == [
        {"role": "system", "content": prefix},
        {"role": "user", "content": ds.prompts[1].prompt},
    ]
    assert build_dataset(**args, shared_prefix_len=24).prompts[0].prefix == prefix
    assert build_dataset(**{**args, "seed": 8}, shared_prefix_len=24).prompts[0].prefix != prefix
    assert "same 24-token prefix of random tokens" in ds.notes[-1]


def test_shared_prefix_without_tokenizer_and_on_chats(tmp_path):
    ds = build_dataset("stdlib", 3, 10, 4, 0.0, None, None, 1, shared_prefix_len=9)
    prefix = ds.prompts[0].prefix
    assert len(prefix.split()) == 9 and all(p.prefix == prefix for p in ds.prompts)
    assert "common words" in ds.notes[-1]
    # a conversation's own system message keeps its place, after the prefix
    f = tmp_path / "c.jsonl"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    f.write_text(json.dumps({"messages": messages}) + "\n")
    ds = build_dataset("jsonl", 2, 10, 4, 0.0, str(f), None, 1, shared_prefix_len=3)
    sent = request_body(LoadConfig("http://x", endpoint="chat"), ds.prompts[1])["messages"]
    assert sent == [
        {"role": "system", "content": ds.prompts[1].prefix + "\n\nBe brief."},
        {"role": "user", "content": "hi"},
    ]
    assert jsonl_dataset(f, 1, 4).prompts[0].prefix == ""  # the file's prompts untouched
    with pytest.raises(DatasetError, match="--shared-prefix-len must be >= 0"):
        build_dataset("random", 1, 4, 4, 0.0, None, None, 0, shared_prefix_len=-1)


def test_multi_turn_dataset_and_turn_prompts():
    ds = build_dataset("multi-turn", 3, 6, 5, 0.0, None, None, 2, shared_prefix_len=4, turns=2)
    assert ds.name == "multi-turn" and ds.num_requests == 6
    assert all(isinstance(c, Conversation) and c.turns == 2 for c in ds.prompts)
    assert all(c.prefix == ds.prompts[0].prefix != "" for c in ds.prompts)
    questions = [q for c in ds.prompts for q in c.questions]
    assert len(set(questions)) == 6 and all(len(q.split()) == 6 for q in questions)
    # seeded, and the same conversations without the prefix
    assert multi_turn_dataset(3, 2, 6, 5, seed=2).prompts == [
        replace(c, prefix="") for c in ds.prompts
    ]
    assert build_dataset("multi-turn", 2, 6, 5, 0.0, None, None, 0).prompts[0].turns == 4
    with pytest.raises(DatasetError, match="--turns applies to --dataset multi-turn only"):
        build_dataset("random", 1, 4, 4, 0.0, None, None, 0, turns=2)
    with pytest.raises(DatasetError, match="--turns must be >= 1"):
        build_dataset("multi-turn", 1, 4, 4, 0.0, None, None, 0, turns=0)

    c = Conversation(["q0", "q1", "q2"], [3, 4, 5], prefix="P")
    turn = c.turn_prompt(2, ["a0", "a1"], chat=True)
    assert turn.prompt == [
        {"role": "user", "content": "q0"},
        {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    assert turn.max_tokens == 5 and turn.prefix == "P"
    assert c.turn_prompt(2, ["a0", "a1"], chat=False).prompt == "q0a0\n\nq1a1\n\nq2"
    assert c.turn_prompt(0, [], chat=False).prompt == "q0"
    with pytest.raises(ValueError, match="needs the 1 answers before it"):
        c.turn_prompt(1, [], chat=True)


def test_chat_turns_carry_the_servers_answers(stub):
    """Each turn's history is the earlier questions and the answers the server actually gave
    them (every assistant message equals the answer to exactly the messages before it), a
    conversation holds one slot of the concurrency limit, and the report has the cache's
    share overall and by turn."""
    stub.reset()
    ds = build_dataset("multi-turn", 3, 5, 4, 0.0, None, None, 0, shared_prefix_len=6, turns=3)
    prefix = ds.prompts[0].prefix
    cfg = LoadConfig(base_url=stub.url, model="stub", endpoint="chat", max_concurrency=2)
    report = benchmark(cfg, ds, progress=False)
    assert report["completed"] == report["num_requests"] == 9 and report["failed"] == 0
    assert len(stub.requests) == 9 and stub.max_in_flight <= 2
    answer_to = {json.dumps(body["messages"]): answer for body, answer in stub.requests}
    for body, _ in stub.requests:
        messages = body["messages"]
        assert messages[0] == {"role": "system", "content": prefix}
        assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * (
            len(messages) // 2 - 1
        ) + ["user"]
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                assert m["content"] == answer_to[json.dumps(messages[:i])]
    last_turns = {
        tuple(m["content"] for m in body["messages"] if m["role"] == "user")
        for body, _ in stub.requests
        if len(body["messages"]) == 6
    }
    assert last_turns == {tuple(c.questions) for c in ds.prompts}
    # a conversation holds its slot from first turn to last: at most two under way at once
    first_question = [body["messages"][1]["content"] for body, _ in stub.requests]
    spans = [
        (first_question.index(q), len(first_question) - first_question[::-1].index(q) - 1)
        for q in set(first_question)
    ]
    assert max(sum(a <= i <= b for a, b in spans) for i in range(9)) <= 2
    # per turn 100, 200, 300 prompt tokens with 0, 100, 200 cached
    assert report["prefix_cache_hit_share"] == pytest.approx(900 / 1800)
    assert report["total_cached_prompt_tokens"] == 900 and report["cached_tokens_reported"] == 9
    assert [(t["turn"], t["completed"]) for t in report["by_turn"]] == [(0, 3), (1, 3), (2, 3)]
    assert [t["prefix_cache_hit_share"] for t in report["by_turn"]] == pytest.approx(
        [0, 0.5, 2 / 3]
    )
    assert [t["prompt_tokens_mean"] for t in report["by_turn"]] == [100, 200, 300]
    assert all(t["ttft_ms_mean"] > 0 for t in report["by_turn"])
    assert report["dataset"]["shared_prefix_len"] == 6


def test_completion_turns_append_answer_and_question(stub):
    """Completions: turn t + 1's prompt is turn t's prompt, the server's answer to it, a
    blank line and the next question."""
    stub.reset(cached="absent")
    ds = build_dataset("multi-turn", 2, 4, 4, 0.0, None, None, 5, shared_prefix_len=3, turns=3)
    cfg = LoadConfig(base_url=stub.url, model="stub", max_concurrency=2)
    report = benchmark(cfg, ds, progress=False)
    assert report["completed"] == 6
    answer_to = {body["prompt"]: answer for body, answer in stub.requests}
    expected = set()
    for c in ds.prompts:
        prompt = c.prefix + "\n\n" + c.questions[0]
        for question in c.questions[1:]:
            expected.add(prompt)
            prompt = prompt + answer_to[prompt] + "\n\n" + question
        expected.add(prompt)
    assert set(answer_to) == expected and len(expected) == 6
    assert report["prefix_cache_hit_share"] is None  # not reported: unknown, not 0
    assert report["total_cached_prompt_tokens"] is None and report["cached_tokens_reported"] == 0
    assert [t["prefix_cache_hit_share"] for t in report["by_turn"]] == [None] * 3


def test_a_failed_turn_ends_its_conversation(stub):
    stub.reset(fail_turn=1)
    ds = build_dataset("multi-turn", 3, 4, 4, 0.0, None, None, 0, turns=3)
    cfg = LoadConfig(base_url=stub.url, model="stub", endpoint="chat")
    report = benchmark(cfg, ds, progress=False)
    assert report["num_requests"] == 9 and report["completed"] == 3
    assert report["errors"] == {"HTTP 500": 3, NOT_SENT: 3}
    assert [t["completed"] for t in report["by_turn"]] == [3, 0, 0]
    assert len(stub.requests) == 3  # the third turns were never sent


def test_sweep_warm_up_sends_a_conversations_first_turn(stub):
    stub.reset()
    c = Conversation(["first question", "second"], [40, 40])
    load = LoadConfig(base_url="http://unused", model="stub", endpoint="chat")
    warm_up(load, SimpleNamespace(url=stub.url), c, 2)
    sent = [body for body, _ in stub.requests]
    assert [b["messages"] for b in sent] == [[{"role": "user", "content": "first question"}]] * 2
    assert all(b["max_tokens"] == 16 for b in sent)


def _usage_stream(usage: dict) -> bytes:
    text = _sse({"choices": [{"index": 0, "text": "hi"}], "usage": None})
    return text + _sse({"choices": [], "usage": usage}) + b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("details", "cached"),
    [
        ({"prompt_tokens_details": {"cached_tokens": 7}}, 7),
        ({"prompt_tokens_details": {"cached_tokens": 0}}, 0),
        ({"prompt_tokens_details": {"cached_tokens": None}}, None),
        ({"prompt_tokens_details": None}, None),
        ({}, None),
    ],
)
def test_cached_tokens_parsed_from_usage(details, cached):
    usage = {"prompt_tokens": 10, "completion_tokens": 1, **details}

    body = _usage_stream(usage)
    response = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)

    async def one() -> RequestResult:
        async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(response)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(reply, "127.0.0.1", 0)
        async with server:
            url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            cfg = LoadConfig(url)
            async with client_session(cfg) as client:
                return await send_request(client, cfg, BenchPrompt("p", 1), 0.0)

    r = asyncio.run(one())
    assert r.ok and r.prompt_tokens == 10 and r.cached_prompt_tokens == cached


def _done(prompt, cached, turn=0, ttft=0.1):
    return RequestResult(
        ok=True,
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        output_tokens=2,
        usage_reported=True,
        ttft_s=ttft,
        latency_s=0.2,
        turn=turn,
    )


def test_report_hit_share_and_turn_rows():
    report = summarize([_done(100, 25), _done(300, None), _done(100, 75, turn=1, ttft=0.3)], 1.0)
    assert report["prefix_cache_hit_share"] == pytest.approx(100 / 200)  # the reported two
    assert report["total_cached_prompt_tokens"] == 100 and report["cached_tokens_reported"] == 2
    assert report["by_turn"][0]["ttft_ms_mean"] == pytest.approx(100.0)
    assert report["by_turn"][1]["ttft_ms_mean"] == pytest.approx(300.0)
    assert report["by_turn"][0]["prompt_tokens_mean"] == 200
    rows = dict(report_rows(report))
    assert rows["prefix cache hit share"] == "50.0% (100 tokens), reported by 2 of 3 requests"
    assert rows["turn 2: TTFT mean (ms) / prompt tokens / cache hit"] == "300.0 / 100 / 75.0%"
    single = summarize([_done(100, None), _done(50, None)], 1.0)
    assert single["prefix_cache_hit_share"] is None and single["by_turn"] is None
    assert not any("cache" in label or "turn" in label for label, _ in report_rows(single))


def test_cli_multi_turn_run_saves_the_figures(stub, tiny_llama, tmp_path, capsys):
    stub.reset()
    out = tmp_path / "mt.json"
    args = ["bench", "serve", "--base-url", stub.url, "--model", "stub", "--no-progress"]
    rc = main(
        [
            *args,
            "--endpoint",
            "chat",
            "--dataset",
            "multi-turn",
            "--turns",
            "2",
            "--num-prompts",
            "2",
            "--shared-prefix-len",
            "10",
            "--tokenizer",
            str(tiny_llama),
            "--input-len",
            "5",
            "--save-result",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 4 and len(report["by_turn"]) == 2
    assert report["prefix_cache_hit_share"] == pytest.approx(200 / 600)
    assert report["dataset"]["shared_prefix_len"] == 10
    assert report["dataset"]["name"] == "multi-turn" and report["dataset"]["num_prompts"] == 2
    tok = load_tokenizer(resolve_model(str(tiny_llama)))
    system = stub.requests[0][0]["messages"][0]
    assert system["role"] == "system"
    assert len(tok.encode(system["content"], add_special_tokens=False)) == 10
    assert "prefix cache hit share" in printed and "turn 2: TTFT" in printed
    assert main([*args, "--turns", "2"]) == 2
    assert "--turns applies to --dataset multi-turn only" in capsys.readouterr().err


def test_sweep_warm_up_sends_the_shared_prefix(stub):
    # (it once sent the prompt alone: the first measured request then missed the cache)
    stub.reset()
    load = LoadConfig(base_url="http://unused", model="stub", endpoint="completions")
    warm_up(load, SimpleNamespace(url=stub.url), BenchPrompt("question", 64, prefix="shared"), 2)
    assert [b["prompt"] for b, _ in stub.requests] == ["shared\n\nquestion"] * 2
    assert all(b["max_tokens"] == 16 for b, _ in stub.requests)
    stub.reset()
    c = replace(Conversation(["first question", "second"], [40, 40]), prefix="shared")
    warm_up(replace(load, endpoint="chat"), SimpleNamespace(url=stub.url), c, 1)
    assert stub.requests[0][0]["messages"][0] == {"role": "system", "content": "shared"}
