"""Grammar workers in the server (`--grammar-workers`): the engine process starts them with
the first request that brings a grammar; a JSON-mode request of 128 choices fills its masks
there once they are ready (128 constrained rows a step), its sampled choices equal those of
a server without workers (and before they are ready too), and SIGTERM ends the workers with
the server."""

from __future__ import annotations

import json
import time

import openai
import psutil

from tests.server.conftest import ServerProcess

FLAGS = ("--speculative-algorithm", "none", "--max-num-seqs", "128")


def _choices(srv: ServerProcess) -> list[str]:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "a JSON object, please"}],
        n=128,  # one step's rows: 128, each constrained
        max_tokens=12,
        temperature=1.0,
        seed=7,
        response_format={"type": "json_object"},
    )
    texts = [c.message.content for c in r.choices]
    for c in r.choices:  # legal JSON, or a prefix of it cut by max_tokens
        if c.finish_reason == "stop":
            json.loads(c.message.content)
    return texts


def _workers(srv: ServerProcess) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(srv.proc.pid).children(recursive=True)
        if "specserve.runtime.grammar_pool" in " ".join(p.cmdline())
    ]


def test_the_servers_workers_fill_masks_and_end_with_it(tiny_llama, tmp_path):
    plain = ServerProcess(tiny_llama, tmp_path / "plain", *FLAGS, "--grammar-workers", "0")
    try:
        expected = _choices(plain)
        assert _workers(plain) == []
    finally:
        assert plain.terminate() == 0
    srv = ServerProcess(tiny_llama, tmp_path / "workers", *FLAGS, "--grammar-workers", "2")
    try:
        assert _workers(srv) == []  # started by the first request that brings a grammar
        # (its steps fill their masks in the engine until the workers are ready: a worker
        # starts in ~2 s of CPU, ~35 requests on a 2-core machine whose engine is busy)
        deadline = time.monotonic() + 180.0
        while True:
            assert _choices(srv) == expected
            workers = _workers(srv)
            assert len(workers) == 2
            # each worker maps the step's shared bitmask once it fills masks (the file is
            # removed once both have)
            mapped = [
                [m.path for m in w.memory_maps() if "specserve-masks-" in m.path] for w in workers
            ]
            if all(mapped) or time.monotonic() > deadline:
                break
        assert all(mapped), mapped
    finally:
        assert srv.terminate() == 0
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
