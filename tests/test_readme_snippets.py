"""The README's Python snippets run as written (on a tiny model instead of the embedded one):
the offline API of "Using it", and the openai client of "Serving" against a live server
started with the README's own flags; LLM.chat answers as the server's chat endpoint."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from specserve import LLM, SamplingParams

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def blocks(section: str, language: str) -> list[str]:
    """The fenced `language` blocks of the README section titled `section`."""
    body = README.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", body, re.S)


def test_the_python_snippet_of_using_it_runs(tiny_llama, capsys):
    code = blocks("Using it", "python")[0]
    assert code.count("LLM()") == 1
    scope: dict = {}
    exec(code.replace("LLM()", f"LLM({str(tiny_llama)!r})"), scope)  # the tiny model
    outs = scope["outs"]
    assert len(outs) == 2 and len(outs[0].logprobs) == len(outs[0].token_ids) > 0
    assert len(capsys.readouterr().out.splitlines()) >= 3


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    """`specserve serve` with the README's flags, on a free port, serving the tiny model."""
    from specserve.bench.server_process import ServerProcess

    shell = blocks("Serving", "bash")[0]
    assert "pip install openai" in shell
    line = next(ln for ln in shell.splitlines() if ln.startswith("specserve serve"))
    args = shlex.split(line.split("&")[0])[2:]
    port = args.index("--port")
    del args[port : port + 2]  # ServerProcess picks a free port
    env = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}  # a small, shared machine
    srv = ServerProcess(
        [*args, "--model", str(tiny_llama)],
        tmp_path_factory.mktemp("readme") / "server.log",
        env=env,
    )
    srv.api_key = args[args.index("--api-key") + 1]
    yield srv
    srv.stop()


def test_the_openai_snippet_of_serving_runs(server, capsys):
    pytest.importorskip("openai")
    code = blocks("Serving", "python")[0]
    assert code.count("http://127.0.0.1:8000") == 1
    exec(code.replace("http://127.0.0.1:8000", server.url), {})
    assert capsys.readouterr().out.endswith("\n")


def test_llm_chat_answers_as_the_chat_endpoint(server, tiny_llama):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)
    llm = LLM(str(tiny_llama))
    conversations = [
        [{"role": "user", "content": "The quick brown fox"}],
        [
            {"role": "system", "content": "Paged attention"},
            {"role": "user", "content": "Speculative decoding drafts tokens"},
        ],
    ]
    served = client.models.list().data[0].id
    for messages in conversations:
        reply = client.chat.completions.create(
            model=served, messages=messages, max_tokens=12, temperature=0
        )
        out = llm.chat(messages, SamplingParams(max_tokens=12))[0]
        assert reply.choices[0].message.content == out.text
        assert reply.usage.completion_tokens == len(out.token_ids)
        assert reply.choices[0].finish_reason == out.finish_reason
