"""Engine configuration: batching limits, KV-cache size, backend and dtype (validated once, up front)."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.device import DEFAULT_DEVICE, resolve_device
from quantkit.errors import QuantkitError

BACKENDS = ("auto", "torch", "triton")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_KV_CACHE_MEMORY = 256 * 1024**2  # bytes, when neither num_kv_blocks nor kv_cache_memory is given
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # auto: the compute dtype; int8/fp8: 8-bit values with scales
SPECULATIVE_METHODS = ("ngram", "draft")  # prompt lookup, or a smaller draft model
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class EngineConfig:
    max_num_seqs: int = 32  # running sequences at most
    max_num_batched_tokens: int = 4096  # tokens per step at most
    max_model_len: int | None = None  # prompt + completion at most; None: min(model's max positions, 4096)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # KV blocks; None: sized from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for the KV cache (all layers, K and V)
    backend: str = "auto"  # "auto": triton on CUDA when available, else torch
    dtype: str = "auto"  # compute / KV dtype; "auto": float32 on CPU, bfloat16 on CUDA
    device: str = DEFAULT_DEVICE  # "auto": cuda when available, else cpu (quantkit.device)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = False
    seed: int = 0  # seeds the engine's generator for requests without their own seed
    kv_cache_dtype: str = "auto"  # see KV_CACHE_DTYPES
    speculative: str | None = None  # None (off), or one of SPECULATIVE_METHODS
    num_speculative_tokens: int = 4  # K: tokens drafted per step, 1..MAX_SPECULATIVE_TOKENS
    draft_model: str | None = None  # with speculative="draft": a smaller model with the same tokenizer

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            _positive_int(name, getattr(self, name))
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.backend not in BACKENDS:
            raise QuantkitError(f"backend={self.backend!r} is invalid; use one of {list(BACKENDS)}")
        if self.dtype not in DTYPES:
            raise QuantkitError(f"dtype={self.dtype!r} is invalid; use one of {list(DTYPES)}")
        resolve_device(self.device)  # an unknown or unavailable device fails before the model is loaded
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise QuantkitError("give num_kv_blocks or kv_cache_memory, not both")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            valid = list(KV_CACHE_DTYPES)
            raise QuantkitError(f"kv_cache_dtype={self.kv_cache_dtype!r} is invalid; use one of {valid}")
        self._check_speculation()

    def _check_speculation(self) -> None:
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise QuantkitError(
                f"speculative={self.speculative!r} is invalid; use one of {list(SPECULATIVE_METHODS)} (or leave it off)"
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise QuantkitError(
                f"num_speculative_tokens={k!r} is invalid; use an integer from 1 to {MAX_SPECULATIVE_TOKENS}"
            )
        if self.speculative == "draft" and not self.draft_model:
            raise QuantkitError("speculative='draft' needs a draft model; pass draft_model (--draft-model)")
        if self.draft_model and self.speculative != "draft":
            raise QuantkitError("draft_model is used only with speculative='draft'; add --speculative draft")

    def resolved_max_model_len(self, model_max_positions: int) -> int:
        if self.max_model_len is None:
            return min(model_max_positions, 4096)
        if self.max_model_len > model_max_positions:
            raise QuantkitError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                f"{model_max_positions}; lower max_model_len"
            )
        return self.max_model_len

    def num_blocks(self, bytes_per_block: int) -> int:
        """KV blocks to allocate, from ``num_kv_blocks`` or the memory budget."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        memory = self.kv_cache_memory if self.kv_cache_memory is not None else DEFAULT_KV_CACHE_MEMORY
        blocks = memory // bytes_per_block
        if blocks < 1:
            raise QuantkitError(
                f"kv_cache_memory={memory} bytes holds no KV block ({bytes_per_block} bytes each); give it more memory"
            )
        return blocks


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise QuantkitError(f"{name}={value!r} is invalid; use an integer >= 1")
