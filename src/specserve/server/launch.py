"""`specserve serve`: start the engine process, then uvicorn; SIGTERM shuts down cleanly.

Order of events: the engine process is spawned and loads the model while this process
loads the tokenizer; the port is bound only once the engine is ready. On SIGTERM (or
SIGINT) uvicorn stops accepting connections, new API requests get 503, in-flight ones get
`shutdown_timeout_s` to finish, then they are aborted (their responses end with a 503
error, or an error event and [DONE] when streaming); then the engine process is stopped and
the command returns 0. A SIGTERM before the server has started (the engine may take
minutes to load) stops the start-up and the engine process with it: status 143.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

import uvicorn

from specserve.core.config import EngineConfig
from specserve.model.loader import load_tokenizer, resolve_model
from specserve.server.app import ServerState, build_app
from specserve.server.config import ServerConfig
from specserve.server.engine_client import EngineClient
from specserve.server.guard import guarded_http
from specserve.server.inputs import InputProcessor
from specserve.server.metrics import ServerMetrics
from specserve.server.openai_format import SIMULATED_FINGERPRINT, TokenText

logger = logging.getLogger("specserve.server")
_SHUTDOWN_BACKSTOP_S = 5.0
ENGINE_DIED_EXIT_CODE = 3  # the server ran, then its engine process died


class _StartupTerminated(SystemExit):
    """SIGTERM before the server started (exit status 128 + 15, as the signal's own)."""


def _stop_starting(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (a second one must not cut the cleanup)
    raise _StartupTerminated(128 + signum)


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        self.state.begin_shutdown()
        super().handle_exit(sig, frame)


def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code."""
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(message)s")
    # Until uvicorn's handlers take over, SIGTERM stops the start-up (the engine process,
    # which ignores SIGTERM, is killed on the way out; `run_engine` also ends itself
    # when this process is gone).
    signal.signal(signal.SIGTERM, _stop_starting)
    client = None
    try:
        # a bad path fails before anything starts
        source = resolve_model(engine_config.load.model, engine_config.load.format)
        metrics = ServerMetrics()
        client = EngineClient(engine_config, metrics, config)
        tokenizer = load_tokenizer(source)  # while the engine process loads the model
        info = client.wait_ready()
        state = ServerState(
            config=config,
            client=client,
            inputs=InputProcessor(tokenizer, info),
            metrics=metrics,
            token_text=TokenText(tokenizer),
            served_names=config.served_model_names or [info.model_name],
        )
        server = _http_server(state)  # (its signal handlers replace `_stop_starting`)
    except BaseException as e:
        if client is not None:
            client.kill(grace_s=0)
        if isinstance(e, _StartupTerminated):
            logger.warning("stopped by SIGTERM while starting")
            return e.code
        raise
    return _serve(server)


def _http_server(state: ServerState) -> _Server:
    config, client = state.config, state.client
    app = build_app(state)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.access_log,
        # A backstop: the app itself aborts what is left after shutdown_timeout_s.
        timeout_graceful_shutdown=config.shutdown_timeout_s + _SHUTDOWN_BACKSTOP_S,
        lifespan="on",
        # httptools (else h11) with a deadline for request headers (server/guard.py); idle
        # keep-alive too; uvloop's event loop where it is installed
        http=guarded_http(config.request_read_timeout_s),
        loop="auto",
        timeout_keep_alive=config.keep_alive_timeout_s,
    )
    server = _Server(uv_config, state)
    state.close_connection = _connection_closer(server)
    # A dead engine ends the server (in-flight requests have failed already): exit non-zero
    # so that a process manager restarts it (README, Serving).
    client.on_dead = lambda: setattr(server, "should_exit", True)
    # uvicorn re-raises the signal it handled once it has shut down; with these handlers in
    # place that is a no-op and the command exits 0 instead of dying from the signal. One
    # that comes before uvicorn's handlers are in place shuts the server down as they would.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda sig, frame: server.should_exit or server.handle_exit(sig, frame))
    return server


def _serve(server: _Server) -> int:
    state = server.state
    config, client = state.config, state.client
    logger.info("engine ready with %s; starting the HTTP server", state.served_names[0])
    if state.client.info.simulated_acceptance:
        logger.warning(
            "SIMULATED ACCEPTANCE is on: speculative acceptance is replaced by seeded draws, "
            "so outputs are NOT the model's; every response carries system_fingerprint %r",
            SIMULATED_FINGERPRINT,
        )
    try:
        server.run()
    except SystemExit:
        if server.started:
            raise
        # uvicorn exits 3 when it cannot bind, which is this command's code for "the engine
        # died while serving"; could-not-start is 1 (its log said why: the address)
        logger.error("the HTTP server could not start on %s:%s", config.host, config.port)
        return 1
    finally:
        client.kill()
    if client.dead_reason in ("crashed", "exited"):
        logger.error("exiting: the engine process %s", client.dead_reason)
        return ENGINE_DIED_EXIT_CODE
    return 0 if server.started else 1


def _connection_closer(server: uvicorn.Server) -> Callable[[tuple | None], bool]:
    """Closes the connection of a client address at once, its unsent bytes dropped (a
    graceful close would wait for a client that reads nothing); uvicorn then tells the app
    the client left, as when it disconnects. False when no such connection is open."""

    def close(client: tuple | None) -> bool:
        if client is None:
            return False
        for protocol in list(server.server_state.connections):
            if getattr(protocol, "client", None) == client:
                protocol.transport.abort()
                return True
        return False

    return close
