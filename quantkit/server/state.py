"""What every route and the gate share: the engine, the tokenizer thread, the served name and the limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from quantkit.server.async_engine import AsyncEngine
from quantkit.server.metrics import Metrics
from quantkit.server.tokenizing import PromptTokenizer


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    tokenizer: PromptTokenizer
    metrics: Metrics
    model_name: str
    max_model_len: int
    vocab_size: int  # token ids at or above it are refused (400)
    max_body_bytes: int
    body_timeout: float
    max_header_bytes: int = 16384
    # bearer token (UTF-8 bytes) -> the tenant its requests belong to ("key-1", ...: never the key itself); empty: no
    # key required, every request is tenant ""
    api_keys: dict[bytes, str] = field(default_factory=dict)
    cache_salts: dict[str, bytes] = field(default_factory=dict)  # tenant -> its prefix-cache salt (none: shared)
    created: int = field(default_factory=lambda: int(time.time()))  # unix seconds (/v1/models)
    draining: bool = False  # set on SIGTERM: new requests get 503 while running ones finish
