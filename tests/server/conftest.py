"""Run the real server as a subprocess on a free loopback port with a tiny model."""

from __future__ import annotations

import itertools
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from specserve.bench.server_process import ServerProcess as BenchServerProcess

API_KEY = "test-key"
_server_numbers = itertools.count()


class ServerProcess(BenchServerProcess):
    """`specserve serve --model MODEL ARGS` for the server tests: the bench's process wrapper
    (own process group, /health wait, SIGTERM then SIGKILL) plus an optional API key and the
    helpers the tests read (log, metrics)."""

    def __init__(self, model: Path, log_dir: Path, *args: str, api_key: str | None = None):
        self.api_key = api_key
        cli = ["--model", str(model), *args] + (["--api-key", api_key] if api_key else [])
        # One intra-op thread: test machines are small and shared (see engine_proc.py).
        env = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        log_path = log_dir / f"server-{next(_server_numbers)}.log"
        super().__init__(cli, log_path, env=env, start_timeout_s=120.0)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_tail(5000)

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics by name."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) ([-0-9.e+Na]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def wait_metric(self, name: str, value: float, timeout_s: float = 20.0) -> float:
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.metrics().get(name)
            if got == value or time.monotonic() > deadline:
                return got
            time.sleep(0.1)

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and the exit status (the server drains, then exits)."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)


@pytest.fixture(scope="package")
def server(tiny_llama, tmp_path_factory):
    """The default server of this package's tests (API key required)."""
    srv = ServerProcess(
        tiny_llama,
        tmp_path_factory.mktemp("server"),
        "--served-model-name",
        "tinyllama",
        "tiny-alias",
        "--uvicorn-log-level",  # (after the wrapper's warning: the log shows INFO records)
        "info",
        api_key=API_KEY,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)


def read_all(sock) -> bytes:
    """Everything a raw socket receives until the server closes it."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out
