"""What every route and the gate share: the engine, the tokenizer thread, the served name and the limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from quantkit.server.async_engine import AsyncEngine
from quantkit.server.config import ServeConfig
from quantkit.server.metrics import Metrics
from quantkit.server.tokenizing import PromptTokenizer


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    tokenizer: PromptTokenizer
    metrics: Metrics
    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = ServeConfig.max_body_bytes
    body_timeout: float = ServeConfig.body_timeout
    created: int = field(default_factory=lambda: int(time.time()))  # unix seconds (/v1/models)
    draining: bool = False  # set on SIGTERM: new requests get 503 while running ones finish
