"""The load generator against a server that fails some requests: every failure is counted by
its kind and the run finishes; nothing crashes."""

from __future__ import annotations

import json
import threading
import time

import pytest
import uvicorn

from specserve.bench.datasets import random_dataset
from specserve.bench.load import LoadConfig
from specserve.bench.runner import benchmark
from specserve.bench.server_process import free_port
from specserve.cli import main


def _chunk(text: str) -> bytes:
    body = {"choices": [{"index": 0, "text": text, "finish_reason": None}], "usage": None}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class FlakyServer:
    """A stub OpenAI server (raw ASGI). Request i of /v1/completions: i % 5 == 0 -> 500,
    1 -> 429, 2 -> an error event in the middle of the stream, 3 -> the stream stops without
    [DONE], 4 -> a good stream of three chunks with usage. No /metrics (404)."""

    def __init__(self):
        self.count = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] != "/v1/completions":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"not found"})
            return
        while (await receive()).get("more_body"):
            pass
        kind = self.count % 5
        self.count += 1
        if kind in (0, 1):
            status = 500 if kind == 0 else 429
            body = json.dumps({"error": {"message": "no", "type": "server_error"}}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": _chunk(" one"), "more_body": True})
        if kind == 2:
            err = {
                "error": {
                    "message": "engine died",
                    "type": "server_error",
                    "code": "engine_unavailable",
                }
            }
            await send(
                {
                    "type": "http.response.body",
                    "more_body": True,
                    "body": b"data: " + json.dumps(err).encode() + b"\n\n",
                }
            )
        elif kind == 4:
            usage = {
                "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            }
            for text in (" two", " three"):
                await send({"type": "http.response.body", "body": _chunk(text), "more_body": True})
            await send(
                {
                    "type": "http.response.body",
                    "more_body": True,
                    "body": b"data: " + json.dumps(usage).encode() + b"\n\n",
                }
            )
        if kind != 3:
            await send(
                {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True}
            )
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture(scope="module")
def flaky_url():
    port = free_port()
    config = uvicorn.Config(
        FlakyServer(), host="127.0.0.1", port=port, log_level="error", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_errors_counted_by_kind(flaky_url):
    dataset = random_dataset(10, input_len=8, output_len=4, range_ratio=0.0, tokenizer=None)
    cfg = LoadConfig(base_url=flaky_url, model="stub", max_concurrency=1)
    report = benchmark(cfg, dataset, progress=False)
    assert report["num_requests"] == 10
    assert report["completed"] == 2 and report["failed"] == 8
    assert report["errors"] == {
        "HTTP 500": 2,
        "HTTP 429": 2,
        "stream error (engine_unavailable)": 2,
        "stream ended before [DONE]": 2,
    }
    assert "server_error" in report["error_examples"]["HTTP 429"]
    assert report["total_output_tokens"] == 6 and report["total_input_tokens"] == 10
    assert report["server"] is None  # the stub has no /metrics
    assert report["ttft_ms"]["p50"] is not None and report["itl_ms"]["p50"] is not None


def test_unreachable_server_is_counted_not_raised():
    dataset = random_dataset(3, input_len=4, output_len=2, range_ratio=0.0)
    cfg = LoadConfig(base_url=f"http://127.0.0.1:{free_port()}", model="m", timeout_s=5)
    report = benchmark(cfg, dataset, progress=False)
    assert report["completed"] == 0 and report["errors"] == {"connection refused": 3}
    assert report["ttft_ms"]["p50"] is None


def test_cli_exits_2_when_no_model_can_be_listed(capsys):
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--no-progress"])
    assert rc == 2
    assert "cannot list models" in capsys.readouterr().err


def test_cli_refuses_conversations_on_completions(tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            f"http://127.0.0.1:{free_port()}",
            "--model",
            "m",
            "--dataset",
            "jsonl",
            "--dataset-path",
            str(data),
            "--no-progress",
        ]
    )
    assert rc == 2
    assert "use --endpoint chat" in capsys.readouterr().err


@pytest.mark.parametrize("body", ["[]", '[{"id": "m"}]', '{"data": ["m"]}', '{"data": []}', "x"])
def test_a_model_list_of_another_shape_is_a_clear_error(monkeypatch, body):
    import httpx

    from specserve.bench import runner

    def get(url, **kw):
        return httpx.Response(200, text=body, request=httpx.Request("GET", url))

    monkeypatch.setattr(runner.httpx, "get", get)
    with pytest.raises(runner.BenchError, match="cannot list models at http://h/v1/models"):
        runner.served_model("http://h")


def test_bench_serve_exits_1_when_a_request_failed(flaky_url, capsys):
    """It exited 0 whenever one request completed (a count tested for truth); a sweep and
    the matrix fail alike (test_bench_matrix)."""
    argv = ["bench", "serve", "--base-url", flaky_url, "--model", "stub", "--num-prompts", "5"]
    argv += ["--max-concurrency", "1", "--input-len", "8", "--output-len", "4", "--no-progress"]
    assert main(argv) == 1  # (the stub's five kinds of answer: one good)
    assert "bench serve: 4 of 5 requests failed: exit status 1" in capsys.readouterr().err
