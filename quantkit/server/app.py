"""The OpenAI-compatible HTTP app: ``create_app(engine_or_model, ServeConfig)``.

The app is assembled from one module per concern: the routes (:mod:`quantkit.server.routes`: generation, info,
metrics), the gate in front of them (:mod:`quantkit.server.gate`: drain, API key, body limits, request counts), the
error objects (:mod:`quantkit.server.errors`) and the OpenAPI document (:mod:`quantkit.server.openapi`).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from quantkit.model.gguf_import import ALIASES
from quantkit.runtime.engine import Engine
from quantkit.server.async_engine import AsyncEngine
from quantkit.server.config import ServeConfig
from quantkit.server.errors import add_error_handlers
from quantkit.server.gate import Gate
from quantkit.server.metrics import Metrics
from quantkit.server.openapi import openapi_document
from quantkit.server.protocol import path_redactor
from quantkit.server.routes import generation, info, metrics
from quantkit.server.state import ServerState
from quantkit.server.tokenizing import PromptTokenizer

__all__ = ["ServerState", "create_app", "default_served_name"]


def create_app(engine_or_model: Engine | str | Path, config: ServeConfig | None = None) -> FastAPI:
    """``engine_or_model``: an :class:`Engine`, or anything ``quantkit.LLM`` accepts (loaded now)."""
    config = config or ServeConfig()
    if isinstance(engine_or_model, Engine):
        engine, default_name, given = engine_or_model, default_served_name(engine_or_model.path), None
    else:
        engine, default_name = Engine(engine_or_model, config.engine), default_served_name(engine_or_model)
        given = engine_or_model
    counters = Metrics()
    name = config.served_model_name or default_name
    local = [engine.path, given, config.engine.draft_model]
    redact = path_redactor(str(p) for p in local if p is not None)
    tenants = {key: f"key-{i + 1}" for i, key in enumerate(config.api_keys)}
    state = ServerState(
        engine=AsyncEngine(engine, config.max_queue, counters, redact),
        tokenizer=PromptTokenizer(engine.tokenizer),
        metrics=counters,
        model_name=name,
        max_model_len=engine.max_model_len,
        vocab_size=engine.model.config.vocab_size,
        max_body_bytes=config.resolved_max_body_bytes(engine.max_model_len),
        body_timeout=config.body_timeout,
        max_header_bytes=config.max_header_bytes,
        api_keys={key.encode(): tenant for key, tenant in tenants.items()},
        cache_salts={tenant: _salt(key) for key, tenant in tenants.items()} if config.salts_cache_per_key else {},
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        yield
        state.engine.stop()

    app = FastAPI(title="quantkit", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.openapi = openapi_document(app.openapi, name, engine.max_model_len)  # type: ignore[method-assign]
    app.state.server = state
    app.state.config = config
    app.add_middleware(Gate, state=state)
    add_error_handlers(app)
    for routes in (info, metrics, generation):
        app.include_router(routes.router)
    return app


def _salt(key: str) -> bytes:
    """A key's prefix-cache salt: derived from the key, so it is secret as the key is, and stable across restarts."""
    return hashlib.blake2b(key.encode(), digest_size=16, person=b"quantkit-salt").digest()


def default_served_name(model: str | Path) -> str:
    """The name clients send when ``--served-model-name`` is not given, never a local path: an alias as given (its
    cached directory has the alias's name); a local directory's own name (a Hugging Face cache snapshot: the hub
    id it holds); a hub id as given."""
    text = str(model)
    if text in ALIASES:
        return text
    path = Path(text).expanduser()
    if not path.exists():
        return text  # a hub id: resolving it downloads it into the cache
    path = path.resolve()
    repo = path.parent.parent.name  # <cache>/models--org--name/snapshots/<commit>
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return path.name or "model"
