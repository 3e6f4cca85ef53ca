"""Run the real server as a subprocess on a free loopback port with a tiny model."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`specserve serve` in a subprocess; its output goes to a log file shown on failure."""

    def __init__(self, model: Path, log_dir: Path, *args: str, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_dir / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "specserve.cli", "serve", "--model", str(model),
               "--port", str(self.port), "--disable-uvicorn-access-log", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        # One intra-op thread: test machines are small and shared (see engine_proc.py).
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   OMP_NUM_THREADS="1")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy()

    def _wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics by name."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
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
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="package")
def server(tiny_llama, tmp_path_factory):
    """The default server of this package's tests (API key required)."""
    srv = ServerProcess(tiny_llama, tmp_path_factory.mktemp("server"),
                        "--served-model-name", "tinyllama", "tiny-alias", api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)
