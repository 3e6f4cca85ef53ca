"""Server options (HTTP side); the engine's options stay in specserve.config.EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    """How the HTTP process listens, authenticates, queues and shuts down.

    `max_queue` bounds the engine requests allowed to wait for a running slot (a request with
    n choices counts n); beyond it requests get 429 with Retry-After. `shutdown_timeout_s` is
    how long SIGTERM waits for in-flight requests before aborting them.
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

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535]; got {self.port}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0; got {self.max_queue}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout must be >= 0; got {self.shutdown_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
