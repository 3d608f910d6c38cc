"""Server options (validated once, up front), around the :class:`EngineConfig` of the engine they serve."""

from __future__ import annotations

from dataclasses import dataclass, field

from quantkit.errors import QuantkitError
from quantkit.runtime.config import EngineConfig


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (in-process servers and tests)
    # The `model` clients must send (and see in /v1/models, responses and metrics); None: the alias, the model
    # directory's own name or the hub id (never a local path; see quantkit.server.app.default_served_name).
    served_model_name: str | None = None
    api_key: str | None = None  # bearer token required on every route but /health
    max_queue: int = 256  # requests allowed to wait beyond the running batch; more get 429
    drain_timeout: float = 30.0  # seconds running requests get to finish after SIGTERM
    # A bigger request body gets 413 before it is read. 4 MiB holds a prompt filling a 128k-token context, sent as
    # token ids (~7 bytes each) or as \uXXXX-escaped text (~6 bytes a character), and bounds one request's memory.
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout: float = 10.0  # seconds a client has to send its whole request body; slower ones get 408
    log_level: str = "warning"
    engine: EngineConfig = field(default_factory=EngineConfig)  # checked when built, before any model is loaded

    def __post_init__(self) -> None:
        if not _is_int(self.port) or not 0 <= self.port < 65536:
            raise QuantkitError(f"port={self.port!r} is invalid; use an integer in [0, 65535]")
        if not _is_int(self.max_queue) or self.max_queue < 0:
            raise QuantkitError(f"max_queue={self.max_queue!r} is invalid; use an integer >= 0")
        if not _is_int(self.max_body_bytes) or self.max_body_bytes < 1:
            raise QuantkitError(f"max_body_bytes={self.max_body_bytes!r} is invalid; use an integer >= 1")
        if not self.body_timeout > 0:
            raise QuantkitError(f"body_timeout={self.body_timeout!r} is invalid; use seconds > 0")
        if not self.drain_timeout >= 0:
            raise QuantkitError(f"drain_timeout={self.drain_timeout!r} is invalid; use seconds >= 0")
        if self.served_model_name is not None and not (
            isinstance(self.served_model_name, str) and self.served_model_name.strip()
        ):
            raise QuantkitError(f"served_model_name={self.served_model_name!r} is invalid; pass a non-empty name")
        if self.api_key is not None and not self.api_key:
            raise QuantkitError("api_key is empty; pass a non-empty key or none")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
