"""GGUF metadata: the llama.cpp architecture of a checkpoint, the ``{arch}.*`` hyperparameters and RoPE keys, and
``general.file_type``, as llama.cpp's convert_hf_to_gguf.py writes them (conversion/base.py ``TextModel``,
conversion/llama.py ``LlamaModel``, conversion/qwen.py ``Qwen2Model``/``Qwen3Model``).

The supported architectures are :data:`quantkit.model.architectures.ARCHITECTURES` entries with a ``gguf_arch``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from quantkit.errors import QuantkitError
from quantkit.model.architectures import ARCHITECTURES

if TYPE_CHECKING:
    from quantkit.export.gguf_tensors import Entry

ROPE_TYPES = (None, "default", "linear", "yarn", "llama3")
FILE_TYPES = {
    QType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    QType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
    QType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
}


def llama_arch(config: dict[str, Any]) -> gguf.MODEL_ARCH:
    """llama.cpp's architecture for config.json's ``model_type``; QuantkitError naming the supported ones."""
    model_type = config.get("model_type", "<missing model_type>")
    spec = next((spec for spec in ARCHITECTURES if model_type in spec.model_types), None)
    if spec is None or spec.gguf_arch is None:
        supported = sorted(t for spec in ARCHITECTURES if spec.gguf_arch is not None for t in spec.model_types)
        raise QuantkitError(
            f"architecture {model_type!r} has no GGUF export; GGUF export supports model types {', '.join(supported)}; "
            "convert the float model with llama.cpp's convert_hf_to_gguf.py instead"
        )
    return gguf.MODEL_ARCH[spec.gguf_arch.upper()]


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta"))
    return rope


def check_rope(arch: gguf.MODEL_ARCH, config: dict[str, Any]) -> None:
    rope = rope_parameters(config)
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in ROPE_TYPES or (kind == "llama3" and arch != gguf.MODEL_ARCH.LLAMA):
        raise QuantkitError(
            f"RoPE scaling type {kind!r} has no GGUF export here (supported: default, linear, yarn, llama3 for "
            "Llama); convert the float model with llama.cpp's convert_hf_to_gguf.py instead"
        )


def _add_rope(writer: gguf.GGUFWriter, rope: dict[str, Any]) -> None:
    kind, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
    if kind == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("rope_theta") is not None:
        writer.add_rope_freq_base(rope["rope_theta"])


def add_hparams(writer: gguf.GGUFWriter, arch: gguf.MODEL_ARCH, config: dict[str, Any]) -> None:
    """The ``{arch}.*`` keys convert_hf_to_gguf.py writes for these architectures."""
    writer.add_block_count(int(config["num_hidden_layers"]))
    if (n_ctx := config.get("max_position_embeddings")) is not None:
        writer.add_context_length(int(n_ctx))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    n_head = int(config["num_attention_heads"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or n_head))
    _add_rope(writer, rope_parameters(config))
    if (eps := config.get("rms_norm_eps")) is not None:
        writer.add_layer_norm_rms_eps(float(eps))
    if (head_dim := config.get("head_dim")) is not None:
        writer.add_key_length(int(head_dim))
        writer.add_value_length(int(head_dim))
    if arch == gguf.MODEL_ARCH.LLAMA:  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(int(config["vocab_size"]))
        writer.add_rope_dimension_count(int(head_dim or int(config["hidden_size"]) // n_head))


def llama3_rope_factors(config: dict[str, Any]) -> np.ndarray | None:
    """Llama 3 RoPE: per-frequency divisors llama.cpp reads from ``rope_freqs.weight`` (None for other RoPE)."""
    rope = rope_parameters(config)
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    freqs = 1.0 / (float(rope["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    factors = np.where(wavelen > old_ctx / low, factor, 1 / ((1 - smooth) / factor + smooth))
    return np.where(wavelen < old_ctx / high, 1.0, factors).astype(np.float32)


def model_name(config: dict[str, Any], path: Path) -> str:
    """general.name: the model's own name where config.json kept one, else the checkpoint directory's."""
    name = config.get("_name_or_path") or config.get("_model_name_or_path") or path.name
    return Path(str(name)).name or path.name


def file_type(plan: Iterable[Entry]) -> gguf.LlamaFileType:
    """general.file_type: the block type that holds the most quantized weights."""
    counts: Counter[QType] = Counter()
    for entry in plan:
        if entry.qtype in FILE_TYPES:
            counts[entry.qtype] += math.prod(entry.shape)
    return FILE_TYPES[counts.most_common(1)[0][0]]
