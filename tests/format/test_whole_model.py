"""inspect's whole-model bytes: the parts (codes, scales, zero points, metadata, embedding, head, norms) add up to
the shards' tensor bytes (file size less the safetensors header), the whole-file bits per weight is those bytes over
the source's parameters, and a quantized untied head is counted as the rotation's untie cost."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from quantkit.format.inspect import inspect_checkpoint
from quantkit.format.scheme import QuantScheme
from quantkit.format.whole_model import (
    CODES,
    EMBEDDINGS,
    HEAD,
    NORMS,
    QUANTIZED_EMBEDDINGS,
    QUANTIZED_HEAD,
    SCALES,
    ZEROS,
    part_of,
)
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.pipeline import quantize_model


def _tensor_bytes(path: Path) -> int:
    """Every shard's size less its 8-byte length and JSON header: the tensors' data bytes."""
    total = 0
    for shard in path.glob("*.safetensors"):
        with shard.open("rb") as handle:
            header = struct.unpack("<Q", handle.read(8))[0]
        total += shard.stat().st_size - 8 - header
    return total


def _quantize(model, calib, out, *algorithms, scheme=QuantScheme(bits=4, group_size=32, symmetric=False)):
    config = QuantizeConfig.for_method("rtn", *algorithms, scheme=scheme, calibration_file=calib, show_progress=False)
    quantize_model(str(model), config, out)
    return out


def test_part_of_names_what_a_tensor_holds():
    quantized = {"model.layers.0.mlp.down_proj": 1, "lm_head": 1}
    assert part_of("model.layers.0.mlp.down_proj.weight_packed", quantized) == CODES
    assert part_of("model.layers.0.mlp.down_proj.weight_zero_point", quantized) == ZEROS
    assert part_of("lm_head.weight_scale", quantized) == QUANTIZED_HEAD
    assert part_of("model.embed_tokens.weight_packed", {"model.embed_tokens": 1}) == QUANTIZED_EMBEDDINGS
    assert part_of("lm_head.weight", {}) == HEAD
    assert part_of("model.embed_tokens.weight", quantized) == EMBEDDINGS
    assert part_of("model.norm.weight", quantized) == NORMS


def test_the_parts_add_up_to_the_files_tensor_bytes(tiny_model_dir, tiny_calib_file, tmp_path):
    out = _quantize(tiny_model_dir, tiny_calib_file, tmp_path / "asym")
    report = inspect_checkpoint(out)
    assert report.tensor_bytes == _tensor_bytes(out)
    parts = {p.part: p for p in report.parts}
    assert {CODES, SCALES, ZEROS, EMBEDDINGS, HEAD, NORMS} <= set(parts)
    vocab, hidden = 256, 64
    assert parts[EMBEDDINGS].bytes == parts[HEAD].bytes == 4 * vocab * hidden  # float32 tiny model
    assert parts[CODES].params == report.quantized_params and parts[CODES].bytes == report.quantized_params // 2
    # an untied source: every stored parameter is the source's
    assert report.model_bits_per_weight == pytest.approx(8 * report.tensor_bytes / report.total_params)


def test_a_quantized_untied_head_is_the_untie_cost(tmp_path, tiny_calib_file):
    from helpers.tiny import save_tiny_model

    from quantkit.quantization.methods.head_quant import HeadQuantConfig
    from quantkit.quantization.methods.rotation import RotationConfig

    tied = save_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    scheme = QuantScheme(bits=4, group_size=32)
    floated = inspect_checkpoint(_quantize(tied, tiny_calib_file, tmp_path / "f", RotationConfig(), scheme=scheme))
    quantized = inspect_checkpoint(
        _quantize(tied, tiny_calib_file, tmp_path / "q", RotationConfig(), HeadQuantConfig("int8"), scheme=scheme)
    )
    vocab, hidden = 256, 64
    assert floated.untied_head_bytes == 4 * vocab * hidden
    assert quantized.untied_head_bytes == vocab * hidden + 4 * vocab  # int8 codes + one float32 scale a row
    assert quantized.tensor_bytes == _tensor_bytes(Path(quantized.path))
    # the source has no head of its own: both count the same source parameters
    assert floated.total_params - vocab * hidden == quantized.total_params - vocab * hidden
    head_row = next(p for p in quantized.parts if p.part == QUANTIZED_HEAD)
    assert head_row.params == vocab * hidden and head_row.bytes == quantized.untied_head_bytes + 16  # + weight_shape
    saved = floated.untied_head_bytes - quantized.untied_head_bytes
    assert floated.tensor_bytes - quantized.tensor_bytes == saved - 16  # plus the head's weight_shape (int64 [2])
