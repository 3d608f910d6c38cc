"""Running the app: ``serve`` (blocking, drains on SIGTERM / Ctrl+C) and ``ServerThread`` (in-process, tests)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from quantkit.server.app import create_app
from quantkit.server.config import ServeConfig
from quantkit.server.connection import ConnectionLimits, guarded_protocol
from quantkit.server.protocol import APIError
from quantkit.server.state import ServerState

_FLUSH_S = 2.0  # after the drain timeout: time the ended requests get to send their error responses


def serve(model: str | Path, config: ServeConfig) -> None:
    """Load the model, serve until SIGTERM/SIGINT, then drain: refuse new requests (503), let running ones
    finish (up to ``drain_timeout`` seconds) and return. A second signal stops at once."""
    app = create_app(model, config)
    server = _DrainingServer(_uvicorn_config(app, config.host, config.port), app.state.server)
    server.drain_timeout = config.drain_timeout
    server.run()


def _uvicorn_config(app: FastAPI, host: str, port: int) -> uvicorn.Config:
    """uvicorn with the app's connection limits (:class:`ServeConfig`, :mod:`quantkit.server.connection`)."""
    config: ServeConfig = app.state.config
    limits = ConnectionLimits(
        config.header_timeout, config.write_timeout, config.max_connections, config.max_header_bytes
    )
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=config.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
        http=guarded_protocol(limits, app.state.server.metrics),
        # Connections over the limit are refused by the protocol, with an error object; uvicorn's own check (a
        # plain-text 503 for a request when connections or tasks reach its limit) stays behind it, for tasks that
        # outlive their connection.
        limit_concurrency=config.max_connections + 1,
        timeout_keep_alive=config.keep_alive_timeout,
        h11_max_incomplete_event_size=config.max_header_bytes,
    )


def _bound_port(server: uvicorn.Server) -> int:
    return int(server.servers[0].sockets[0].getsockname()[1])


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = 30.0

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            url = f"http://{self.config.host}:{_bound_port(self)}"
            print(f"quantkit: serving {self.state.model_name!r} at {url}", flush=True)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Unlike uvicorn's, drains first and does not re-raise the signal afterwards (so the exit code is 0)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining:  # a second signal: stop now
            self.should_exit = self.force_exit = True
            return
        self.state.draining = True
        print("quantkit: draining (new requests get 503)", file=sys.stderr, flush=True)
        threading.Thread(target=self._drain, name="quantkit-drain", daemon=True).start()

    def _drain(self) -> None:
        drain(self.state, self.drain_timeout)
        self.should_exit = True


def drain(state: ServerState, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for the requests in flight to finish; then end the rest with an error
    (non-streaming: 503 with an error object; streaming: an error event, then ``data: [DONE]``) and wait a moment
    for those answers to go out. Called from a thread of its own while the server runs."""
    if not _wait_idle(state, timeout):
        message = f"the server is shutting down; the request was stopped after the {timeout:g} s drain timeout"
        state.engine.close(APIError(503, message, "server_error", code="shutting_down"))
        _wait_idle(state, _FLUSH_S)


def _wait_idle(state: ServerState, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while state.engine.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    return not state.engine.num_in_flight


class ServerThread:
    """The app on a loopback port in a background thread: ``with ServerThread(app) as s: httpx.get(s.url)``."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self.server = uvicorn.Server(_uvicorn_config(app, host, port))
        self.host = host
        self.port = port
        self._thread = threading.Thread(target=self.server.run, name="quantkit-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def state(self) -> ServerState:
        return self.app.state.server

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = _bound_port(self.server)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
