"""The server with tensor parallelism (two CPU ranks, gloo): the real openai client gets the
same greedy completions as from a one-rank server, streamed and not, with speculation and
every step's tokens compared across ranks; SIGTERM stops every rank."""

from __future__ import annotations

import openai
import psutil

from tests.server.conftest import ServerProcess


def _completions(srv: ServerProcess) -> list[str]:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.api_key or "x", max_retries=0)
    model = client.models.list().data[0].id
    texts = []
    for prompt in ("hello there", "one two three four"):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
        texts.append(r.choices[0].text)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    return texts


def test_a_tensor_parallel_server_answers_as_one_rank(server, tiny_llama, tmp_path):
    # one rank: the package's server, plain decoding (greedy speculation keeps its text)
    expected = _completions(server)
    flags = ("--speculative-algorithm", "ngram", "--speculative-policy", "fixed")
    two = ServerProcess(tiny_llama, tmp_path, *flags, "--tp", "2", "--debug-tp-check")
    try:
        ranks = [p for p in psutil.Process(two.proc.pid).children(recursive=True)]
        assert _completions(two) == expected
    finally:
        assert two.terminate() == 0
    # every rank ends with the server (on a busy machine a rank may still be exiting as the
    # server's process returns: a bounded wait, not an instant check)
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_dead_rank_ends_the_server_with_its_name(tiny_llama, tmp_path):
    srv = ServerProcess(tiny_llama, tmp_path, "--tp", "2", "--speculative-algorithm", "none")
    try:
        # the server's engine process (rank 0) spawned rank 1: a spawned process of a spawned one
        (rank_1,) = [
            p
            for p in psutil.Process(srv.proc.pid).children(recursive=True)
            if "spawn_main" in " ".join(p.cmdline()) and p.ppid() != srv.proc.pid
        ]
        rank_1.kill()
        code = srv.proc.wait(timeout=60)  # not a hang
    finally:
        srv.stop()
    assert code != 0
    assert "tensor-parallel rank 1 (process " in srv.log()
    assert "was killed by SIGKILL (out of memory?)" in srv.log()
