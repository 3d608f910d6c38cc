"""Engine configuration: batching limits, KV-cache size, backend and dtype (validated once, up front).

Each field's ``help`` (its metadata) is the one description of the option: ``quantkit serve`` and ``quantkit bench``
turn every field into a command-line option with that help and the field's default
(:mod:`quantkit.cli.engine_options`), so a new field is a new option without another edit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quantkit.device import DEFAULT_DEVICE, DEVICE_HELP, resolve_device
from quantkit.errors import QuantkitError

BACKENDS = ("auto", "torch", "triton")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_KV_CACHE_MEMORY = 256 * 1024**2  # bytes, when neither num_kv_blocks nor kv_cache_memory is given
DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # auto: the compute dtype; int8/fp8: 8-bit values with scales
SPECULATIVE_METHODS = ("ngram", "draft")  # prompt lookup, or a smaller draft model
MAX_SPECULATIVE_TOKENS = 16


def _option(default: Any, help: str) -> Any:
    """A field whose ``help`` is its command-line help."""
    return field(default=default, metadata={"help": help})


@dataclass
class EngineConfig:
    max_num_seqs: int = _option(32, "Sequences in the running batch at most.")
    max_num_batched_tokens: int | None = _option(
        None,
        f"Tokens per step at most (default: max({DEFAULT_MAX_NUM_BATCHED_TOKENS}, --max-model-len), so that a whole "
        "prompt fits one prefill step).",
    )
    max_model_len: int | None = _option(None, "Prompt + completion tokens at most (default: min(model's, 4096)).")
    block_size: int = _option(16, "Tokens per KV-cache block.")
    num_kv_blocks: int | None = _option(None, "KV-cache blocks (default: sized from --kv-cache-memory).")
    kv_cache_memory: int | None = _option(
        None, f"Bytes for the KV cache, all layers, K and V (default: {DEFAULT_KV_CACHE_MEMORY // 1024**2} MiB)."
    )
    backend: str = _option("auto", f"Attention backend: {', '.join(BACKENDS)} (auto: triton on CUDA, else torch).")
    dtype: str = _option("auto", f"Compute dtype: {', '.join(DTYPES)} (auto: float32 on CPU, bfloat16 on CUDA).")
    device: str = _option(DEFAULT_DEVICE, DEVICE_HELP)
    enable_prefix_caching: bool = _option(True, "Reuse the KV blocks of prompt prefixes seen before.")
    enable_chunked_prefill: bool = _option(False, "Prefill long prompts in chunks of --max-num-batched-tokens.")
    seed: int = _option(0, "Seeds sampling for requests without their own seed.")
    kv_cache_dtype: str = _option(
        "auto",
        f"KV-cache storage: {', '.join(KV_CACHE_DTYPES)} (auto: the compute dtype, or FP8 under the checkpoint's "
        "k_scale/v_scale when it has a kv_cache_scheme; int8/fp8: 8 bits with a scale per token and head, about 2x "
        "the tokens of bf16 in the same memory).",
    )
    speculative: str | None = _option(
        None,
        f"Speculative decoding: {' or '.join(SPECULATIVE_METHODS)} (n-gram prompt lookup, or --draft-model). Greedy "
        "output is unchanged; sampled output keeps its distribution.",
    )
    num_speculative_tokens: int = _option(4, f"Tokens drafted per step (1..{MAX_SPECULATIVE_TOKENS}).")
    draft_model: str | None = _option(None, "With --speculative draft: a smaller model with the same tokenizer.")

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "block_size"):
            _positive_int(name, getattr(self, name))
        for name in ("max_num_batched_tokens", "max_model_len", "num_kv_blocks", "kv_cache_memory"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.max_num_batched_tokens is None:  # without chunked prefill a whole prompt must fit one step
            self.max_num_batched_tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_model_len or 0)
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
