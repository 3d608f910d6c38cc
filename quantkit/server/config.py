"""Server options (validated once, up front); engine options are turned into an :class:`EngineConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.errors import QuantkitError
from quantkit.runtime.config import EngineConfig


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (in-process servers and tests)
    served_model_name: str | None = None  # the `model` clients must send; None: the MODEL argument as given
    api_key: str | None = None  # bearer token required on every route but /health
    max_queue: int = 256  # requests allowed to wait beyond the running batch; more get 429
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_model_len: int | None = None
    kv_cache_blocks: int | None = None
    drain_timeout: float = 30.0  # seconds running requests get to finish after SIGTERM
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise QuantkitError(f"port={self.port!r} is invalid; use an integer in [0, 65535]")
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise QuantkitError(f"max_queue={self.max_queue!r} is invalid; use an integer >= 0")
        if not self.drain_timeout >= 0:
            raise QuantkitError(f"drain_timeout={self.drain_timeout!r} is invalid; use seconds >= 0")
        if self.api_key is not None and not self.api_key:
            raise QuantkitError("api_key is empty; pass a non-empty key or none")

    def engine_config(self) -> EngineConfig:
        """Batching limits for the engine: a whole prompt of max_model_len tokens must fit one prefill step."""
        return EngineConfig(
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=max(4096, self.max_model_len or 0),
            num_kv_blocks=self.kv_cache_blocks,
        )
