"""Server options (HTTP side); the engine's options stay in specserve.core.config.EngineConfig."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

API_KEY_ENV = "SPECSERVE_API_KEY"


@dataclass
class ServerConfig:
    """How the HTTP process listens, authenticates, queues and shuts down.

    `max_queue` bounds the engine requests allowed to wait for a running slot (each prompt of
    a request times its n choices counts one); beyond it requests get 429 with Retry-After,
    and one request that alone would queue more gets 400. `shutdown_timeout_s` is how long
    SIGTERM waits for in-flight requests before aborting them. With `api_key` set every
    route but /health needs it, /metrics too unless `public_metrics`. A request's headers
    and body must arrive within `request_read_timeout_s` (stalled connections are closed),
    its body may not exceed `max_request_bytes`, and an idle kept-alive connection is
    closed after `keep_alive_timeout_s`.

    Stuck parties (no flags: defaults meant to need no tuning): a stream whose client does
    not read it is stopped once `stream_backlog_bytes` of its output wait undelivered (a
    few MiB is thousands of tokens behind; streams still being delivered count toward
    `max_queue`), and its connection is closed once one write has waited
    `stream_write_timeout_s`. The engine reports at least every second from a thread of its
    own, however long its steps: silent for `engine_silent_timeout_s` it is stopped or hung
    (/health 503, requests in flight fail, new ones get 503 until it answers again); in one
    loop turn for `engine_step_timeout_s` (a step that does not end) /health answers 503
    and nothing is failed, a step that long could still end.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: list[str] = field(default_factory=list)  # empty: the model's name
    max_queue: int = 1024
    shutdown_timeout_s: float = 30.0
    retry_after_s: int = 1
    access_log: bool = True
    log_level: str = "info"
    max_request_bytes: int = 8 * 2**20
    request_read_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    public_metrics: bool = False
    stream_backlog_bytes: int = 16 * 2**20
    stream_write_timeout_s: float = 60.0
    engine_silent_timeout_s: float = 15.0
    engine_step_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535]; got {self.port}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0; got {self.max_queue}")
        if not 0 <= self.shutdown_timeout_s < math.inf:
            raise ValueError(f"--shutdown-timeout must be >= 0; got {self.shutdown_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key (--api-key) must not be empty")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be >= 1024; got {self.max_request_bytes}")
        if self.stream_backlog_bytes < 2**20:
            raise ValueError(
                f"stream_backlog_bytes must be >= 1 MiB; got {self.stream_backlog_bytes}"
            )
        for name, seconds in (
            ("--request-read-timeout", self.request_read_timeout_s),
            ("--keep-alive-timeout", self.keep_alive_timeout_s),
            ("stream_write_timeout_s", self.stream_write_timeout_s),
            ("engine_silent_timeout_s", self.engine_silent_timeout_s),
            ("engine_step_timeout_s", self.engine_step_timeout_s),
        ):
            if not 0 < seconds < math.inf:  # (NaN too: every connection failed on it)
                raise ValueError(f"{name} must be a positive number of seconds; got {seconds}")


def resolve_api_key(flag: str | None, key_file: str | None) -> str | None:
    """The API key from --api-key, else --api-key-file (its first line), else the
    SPECSERVE_API_KEY environment variable (neither of the last two shows in `ps`); None
    when none is given. Raises ValueError when the flag and the file are both given, the
    file cannot be read or the key is empty."""
    if flag is not None and key_file is not None:
        raise ValueError("give the API key once: --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file {key_file!r} cannot be read: {e.strerror}") from e
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"--api-key-file {key_file!r} holds no key on its first line")
        return key
    if flag is not None:
        return flag
    env = os.environ.get(API_KEY_ENV)
    if env is not None and not env.strip():
        raise ValueError(f"{API_KEY_ENV} is set but empty")
    return env.strip() if env else None
