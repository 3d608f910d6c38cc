"""Every test here runs tiny models on one torch thread (see helpers.threads); ``serve`` starts servers on a tiny
model with a 2048-token context (long generations) and stops them after the test."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.threads import torch_threads
from helpers.tiny import save_tiny_model

from quantkit.server import ServerThread, create_app
from server.support import tiny_config


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("abuse") / "model", max_position_embeddings=2048)


@pytest.fixture()
def serve(long_model_dir) -> Iterator[Callable[..., ServerThread]]:
    """``serve(engine={...}, model=None, **ServeConfig fields)``: a started server, stopped after the test."""
    with contextlib.ExitStack() as stack:

        def start(engine: dict | None = None, model: Path | None = None, **server: object) -> ServerThread:
            app = create_app(model or long_model_dir, tiny_config(engine, **server))
            return stack.enter_context(ServerThread(app))

        yield start
