"""Checkpoint size report: bits per weight and totals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.tiny import rtn_for_tests

from quantkit.format.engines import VLLM_VERSION
from quantkit.format.float_engines import AMPERE, BLACKWELL, HOPPER
from quantkit.format.inspect import CheckpointReport, inspect_checkpoint, render_report
from quantkit.format.loads_in import vllm_engine
from quantkit.format.presets import PRESETS
from quantkit.format.quantization_config import build_quantization_config
from quantkit.format.scheme import KVCacheScheme, QuantScheme
from quantkit.format.tensors import linear_tensors
from quantkit.format.writer import SINGLE_FILE, ShardedWriter

N, K = 64, 576


def _write(
    path: Path, scheme: QuantScheme, extra_params: int = 0, n: int = N, k: int = K, kv: KVCacheScheme | None = None
) -> Path:
    """A one-layer checkpoint ("layer.proj", N x K) plus an optional unquantized float tensor and KV cache scheme."""
    qw = rtn_for_tests(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), scheme)
    tensors = linear_tensors("layer.proj", qw, torch.bfloat16)
    if extra_params:
        tensors["norm.weight"] = torch.ones(extra_params, dtype=torch.bfloat16)
    with ShardedWriter(path) as writer:
        writer.add(tensors)
        config = build_quantization_config([(scheme, ["Linear"])], [], kv_cache=kv)
        writer.finalize({}, [], quantization_config=config)
    return path


def test_w4_g128_sym_bits_per_weight(tmp_path: Path) -> None:
    report = inspect_checkpoint(_write(tmp_path / "c", QuantScheme(bits=4, group_size=128), extra_params=100))
    (layer,) = report.layers
    assert (layer.name, layer.scheme, layer.out_features, layer.in_features) == ("layer.proj", "w4-g128-sym", N, K)
    assert layer.bits_per_weight == pytest.approx(4 + 16 * 5 / 576, rel=1e-12)  # 5 bf16 scales per row
    assert report.avg_bits_per_weight == pytest.approx(layer.bits_per_weight, rel=1e-12)
    assert report.quantized_params == N * K
    assert report.total_params == N * K + 100
    assert report.dense_bf16_bytes == 2 * (N * K + 100) and not report.dense_from_reference
    assert report.checkpoint_bytes == (tmp_path / "c" / SINGLE_FILE).stat().st_size
    assert report.compression_ratio == pytest.approx(report.dense_bf16_bytes / report.checkpoint_bytes)


def test_asym_adds_zero_point_bits(tmp_path: Path) -> None:
    report = inspect_checkpoint(_write(tmp_path / "c", QuantScheme(bits=4, group_size=128, symmetric=False)))
    # zero points: int32 [ceil(64*4/32) = 8, 5] = 64*5 4-bit values
    assert report.layers[0].bits_per_weight == pytest.approx(4 + 16 * 5 / 576 + 4 * 5 / 576, rel=1e-12)


def test_per_channel_w8(tmp_path: Path) -> None:
    report = inspect_checkpoint(_write(tmp_path / "c", QuantScheme(bits=8, group_size=-1)))
    assert report.layers[0].scheme == "w8-ch-sym"
    assert report.layers[0].bits_per_weight == pytest.approx(8 + 16 / K, rel=1e-12)


def test_act_order_g_idx_bits(tmp_path: Path) -> None:
    scheme = QuantScheme(bits=4, group_size=128, act_order=True)
    report = inspect_checkpoint(_write(tmp_path / "c", scheme))
    assert report.layers[0].bits_per_weight == pytest.approx(4 + 16 * 5 / 576 + 32 / N, rel=1e-12)


def test_padded_words_are_counted(tmp_path: Path) -> None:
    # K=100 at 3 bits: 300 bits per row, stored in 10 words = 320 bits
    report = inspect_checkpoint(_write(tmp_path / "c", QuantScheme(bits=3, group_size=-1), n=8, k=100))
    assert report.layers[0].bits_per_weight == pytest.approx((320 + 16) / 100, rel=1e-12)


def test_reference_dir_and_rendering(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / SINGLE_FILE).write_bytes(b"x" * 12345)
    report = inspect_checkpoint(_write(tmp_path / "c", QuantScheme(bits=4, group_size=64)), reference=ref)
    assert report.dense_bf16_bytes == 12345 and report.dense_from_reference
    data = report.to_dict()
    assert json.loads(json.dumps(data))["layers"][0]["name"] == "layer.proj"
    assert math.isclose(data["compression_ratio"], 12345 / report.checkpoint_bytes)
    assert isinstance(report, CheckpointReport)
    table, groups, _whole, engines = render_report(report).renderables
    assert table.row_count == 1 and "bits/w" in [c.header for c in table.columns]
    assert groups.row_count == 1
    assert [c.header for c in groups.columns] == [
        "scheme",
        "weights",
        "activations",
        "layers",
        "params",
        "MB",
        "bits/w",
    ]
    assert engines.row_count == len(report.loads_in) == 6  # transformers, vLLM on 3 GPU generations, 2 exports
    assert f"predicted from vLLM {VLLM_VERSION} source" in str(engines.caption)


def test_fp8_dynamic_is_described_and_loads_where_vllm_runs_fp8(tmp_path: Path) -> None:
    report = inspect_checkpoint(_write(tmp_path / "c", PRESETS["FP8_DYNAMIC"], extra_params=100))
    (layer,) = report.layers
    assert (layer.out_features, layer.in_features) == (N, K)  # from the unpacked FP8 weight: no weight_shape
    assert layer.bits_per_weight == pytest.approx(8 + 16 / K, rel=1e-12)  # one bf16 scale per row
    assert report.total_params == N * K + 100
    (group,) = report.groups
    assert (group.weights, group.activations) == ("FP8 e4m3 per-channel", "FP8 dynamic per-token")
    assert report.kv_cache == "16-bit"
    verdicts = {v.engine: v for v in report.loads_in}
    assert verdicts[vllm_engine(HOPPER)].summary == "CUTLASS FP8 1"
    assert verdicts[vllm_engine(AMPERE)].summary.startswith("FP8 Marlin (weight-only")
    assert not verdicts["GGUF (quantkit export)"].loads


def test_nvfp4_with_an_fp8_kv_cache(tmp_path: Path) -> None:
    kv = KVCacheScheme(strategy="attn_head")
    report = inspect_checkpoint(_write(tmp_path / "c", PRESETS["NVFP4A16"], kv=kv))
    (layer,) = report.layers
    assert (layer.out_features, layer.in_features) == (N, K)  # two FP4 codes a byte
    # 4-bit codes, one FP8 scale per 16 weights, a float32 global scale over the whole layer
    assert layer.bits_per_weight == pytest.approx(4 + 8 / 16 + 32 / (N * K), rel=1e-12)
    assert report.groups[0].weights == "NVFP4 g16, FP8 scales + global" and report.groups[0].activations == "16-bit"
    assert report.kv_cache == "FP8, static per-KV-head k/v scales"
    verdicts = {v.engine: v for v in report.loads_in}
    assert verdicts[vllm_engine(HOPPER)].loads and "KV cache: FlashAttention 3" in verdicts[vllm_engine(HOPPER)].summary
    assert not verdicts[vllm_engine(BLACKWELL)].loads  # per-head scales: FlashAttention 3 only
    _, groups, _, _ = render_report(report).renderables
    assert [c.header for c in groups.columns][:3] == ["scheme", "weights", "activations"]
    assert "KV cache: FP8, static per-KV-head k/v scales" in str(groups.caption)
