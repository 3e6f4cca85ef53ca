"""`specserve serve` as a child process on a free loopback port, for the sweep."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from specserve.core.errors import SpecserveError


class ServerStartError(SpecserveError):
    """A server of the sweep exited or never became healthy; the message has its log's end."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the bench dies, however it dies (a
    killed bench must not leave a server holding the GPU's memory)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def terminate_as_exit() -> None:
    """SIGTERM ends this process as an exception would (exit status 143), so that servers
    are stopped and finished results written on the way out."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


class ServerProcess:
    """Starts `specserve serve ARGS` in its own process group, waits for /health, and stops it
    with SIGTERM (then SIGKILL of its group) on `stop` or when used as a context manager."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 600.0,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [
            sys.executable,
            "-m",
            "specserve.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disable-uvicorn-access-log",
            "--uvicorn-log-level",
            "warning",
            *args,
        ]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"the server exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise ServerStartError(
            f"the server was not healthy after {timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of its group (the engine process)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
