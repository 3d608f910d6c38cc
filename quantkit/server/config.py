"""Server options (validated once, up front); engine options are turned into an :class:`EngineConfig`."""

from __future__ import annotations

from dataclasses import dataclass

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
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_model_len: int | None = None
    kv_cache_blocks: int | None = None
    drain_timeout: float = 30.0  # seconds running requests get to finish after SIGTERM
    # A bigger request body gets 413 before it is read. 4 MiB holds a prompt filling a 128k-token context, sent as
    # token ids (~7 bytes each) or as \uXXXX-escaped text (~6 bytes a character), and bounds one request's memory.
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout: float = 10.0  # seconds a client has to send its whole request body; slower ones get 408
    log_level: str = "warning"
    kv_cache_dtype: str = EngineConfig.kv_cache_dtype
    speculative: str | None = EngineConfig.speculative
    num_speculative_tokens: int = EngineConfig.num_speculative_tokens
    draft_model: str | None = EngineConfig.draft_model
    device: str = EngineConfig.device

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
        self.engine_config()  # engine options checked now, before any model is loaded

    def engine_config(self) -> EngineConfig:
        """Batching limits for the engine: a whole prompt of max_model_len tokens must fit one prefill step."""
        return EngineConfig(
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=max(4096, self.max_model_len or 0),
            num_kv_blocks=self.kv_cache_blocks,
            kv_cache_dtype=self.kv_cache_dtype,
            speculative=self.speculative,
            num_speculative_tokens=self.num_speculative_tokens,
            draft_model=self.draft_model,
            device=self.device,
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
