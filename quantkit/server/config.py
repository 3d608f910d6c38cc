"""Server options (validated once, up front), around the :class:`EngineConfig` of the engine they serve.

Each field's ``help`` (its metadata) is the one description of the option: ``quantkit serve`` turns every field but
``engine`` into a command-line option with that help and the field's default (:mod:`quantkit.cli.engine_options`),
as it does for the engine's fields.

The limits a client meets (and what happens past them):

* ``max_queue``: requests waiting beyond the running batch; one more gets 429. When the server is full, a request
  from an API key holding fewer requests than another pushes out that key's newest not-yet-started request (429).
* ``max_body_bytes``: bigger bodies get 413 before they are read; by default just what the longest valid request
  needs for the served context. ``body_timeout``: the whole body within this many seconds, else 408.
* ``header_timeout``: a connection must send a complete request head this soon after it opens (or after its
  previous response); else it is closed. ``max_header_bytes``: a bigger request head gets 400.
* ``keep_alive_timeout``: an idle keep-alive connection is closed after this long.
* ``write_timeout``: a connection whose client reads nothing for this long while the server has output for it
  (a stream nobody reads) is cut; its request is aborted and its KV blocks freed.
* ``max_connections``: open connections at most (uvicorn's ``limit_concurrency``); more are answered 503 and closed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.runtime.config import EngineConfig

# A prompt may hold 32 characters per context token (routes/generation.py); as JSON a character takes up to 6 bytes
# (\uXXXX). Everything else in a valid request (messages, stop strings, logit_bias, ...) fits in 1 MiB.
BODY_BYTES_PER_TOKEN = 32 * 6
BODY_BYTES_BASE = 1 << 20
MAX_DEFAULT_BODY_BYTES = 4 << 20  # the default never exceeds this, whatever the context


def _option(default: Any, help: str, **extra: Any) -> Any:
    """A field whose ``help`` is its command-line help (``envvar``: also read from this environment variable)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class ServeConfig:
    host: str = _option("127.0.0.1", "Address to listen on.")
    port: int = _option(8000, "Port to listen on (0: any free port).")
    served_model_name: str | None = _option(
        None,
        "Model name clients send and see in /v1/models and responses (default: the alias, the model directory's "
        "name or the hub id; never a local path).",
    )
    api_key: list[str] | None = field(
        default=None,
        metadata={
            "help": "Require this bearer token on every route but /health. Repeat for several keys: each key's "
            "requests share the waiting queue fairly with the others' and, by default, get a prefix cache of their "
            "own.",
            "envvar": "QUANTKIT_API_KEY",
        },
    )
    cache_salt_per_key: bool | None = _option(
        None,
        "Salt the prefix cache per API key, so that the time to first token tells no key about another's prompts "
        "(default: on with several keys).",
    )
    max_queue: int = _option(256, "Requests waiting beyond the running batch; more get 429.")
    drain_timeout: float = _option(30.0, "Seconds running requests get after SIGTERM.")
    max_body_bytes: int | None = _option(
        None,
        "Largest request body in bytes; a bigger one gets 413 before it is read (default: what the longest valid "
        f"request needs, {BODY_BYTES_PER_TOKEN} bytes per context token + 1 MiB, at most 4 MiB).",
    )
    body_timeout: float = _option(10.0, "Seconds a client has to send its whole request body; a slower one gets 408.")
    header_timeout: float = _option(
        10.0, "Seconds a connection has to send a whole request head (after it opens or after a response); else closed."
    )
    max_header_bytes: int = _option(16384, "Largest request head (request line and headers); a bigger one gets 400.")
    keep_alive_timeout: float = _option(5.0, "Seconds an idle keep-alive connection stays open.")
    write_timeout: float = _option(
        15.0,
        "Seconds a client may read nothing while the server has output for it; then the connection is cut and its "
        "request aborted (a stream nobody reads frees its slot and KV blocks).",
    )
    max_connections: int = _option(512, "Open connections at most (uvicorn's limit_concurrency); more get 503.")
    log_level: str = _option("warning", "uvicorn log level.")
    engine: EngineConfig = field(default_factory=EngineConfig)  # checked when built, before any model is loaded

    def __post_init__(self) -> None:
        if not _is_int(self.port) or not 0 <= self.port < 65536:
            raise QuantkitError(f"port={self.port!r} is invalid; use an integer in [0, 65535]")
        for name in ("max_queue",):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise QuantkitError(f"{name}={getattr(self, name)!r} is invalid; use an integer >= 0")
        for name in ("max_header_bytes", "max_connections"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise QuantkitError(f"{name}={getattr(self, name)!r} is invalid; use an integer >= 1")
        if self.max_body_bytes is not None and (not _is_int(self.max_body_bytes) or self.max_body_bytes < 1):
            raise QuantkitError(f"max_body_bytes={self.max_body_bytes!r} is invalid; use an integer >= 1")
        for name in ("body_timeout", "header_timeout", "keep_alive_timeout", "write_timeout"):
            if not getattr(self, name) > 0:
                raise QuantkitError(f"{name}={getattr(self, name)!r} is invalid; use seconds > 0")
        if not self.drain_timeout >= 0:
            raise QuantkitError(f"drain_timeout={self.drain_timeout!r} is invalid; use seconds >= 0")
        if self.served_model_name is not None and not (
            isinstance(self.served_model_name, str) and self.served_model_name.strip()
        ):
            raise QuantkitError(f"served_model_name={self.served_model_name!r} is invalid; pass a non-empty name")
        keys = [self.api_key] if isinstance(self.api_key, str) else list(self.api_key or [])
        if any(not isinstance(k, str) or not k for k in keys):
            raise QuantkitError("api_key is empty; pass a non-empty key or none")
        if len(set(keys)) != len(keys):
            raise QuantkitError("an api_key is given twice; give each key once")
        self.api_key = keys or None

    @property
    def api_keys(self) -> tuple[str, ...]:
        return tuple(self.api_key or ())

    @property
    def salts_cache_per_key(self) -> bool:
        return len(self.api_keys) > 1 if self.cache_salt_per_key is None else bool(self.cache_salt_per_key)

    def resolved_max_body_bytes(self, max_model_len: int) -> int:
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return min(MAX_DEFAULT_BODY_BYTES, BODY_BYTES_BASE + BODY_BYTES_PER_TOKEN * max_model_len)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
