"""inspect: layers in natural order, grouped by scheme with per-group sums equal to the totals; sizes in MB only."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli
from helpers.tiny import rtn_for_tests

from quantkit.format.inspect import inspect_checkpoint, natural_key, render_report
from quantkit.format.quantization_config import build_quantization_config
from quantkit.format.scheme import QuantScheme
from quantkit.format.sizes import format_mb, mb_number
from quantkit.format.tensors import linear_tensors
from quantkit.format.writer import ShardedWriter

G32, G64 = QuantScheme(bits=4, group_size=32), QuantScheme(bits=4, group_size=64)
W8 = QuantScheme(bits=8, group_size=-1)
# layer index -> scheme; written in text order (0, 1, 10, 11, 2, 3), which is not the order a reader wants
LAYERS = {0: G32, 1: G64, 2: W8, 3: G64, 10: G32, 11: G64}


def _mixed_checkpoint(path: Path) -> Path:
    tensors = {}
    for i in sorted(LAYERS, key=str):
        weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(i))
        tensors |= linear_tensors(f"model.layers.{i}.mlp.down_proj", rtn_for_tests(weight, LAYERS[i]), torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(128, dtype=torch.bfloat16)
    groups = [(s, [f"model.layers.{i}.mlp.down_proj" for i in LAYERS if LAYERS[i] == s]) for s in (G32, G64, W8)]
    with ShardedWriter(path) as writer:
        writer.add(tensors)
        writer.finalize({}, [], quantization_config=build_quantization_config(groups, []))
    return path


def test_natural_key_orders_numbers_as_numbers() -> None:
    names = ["layers.10.q", "layers.2.q", "layers.1.q", "layers.11.q", "layers.2.k"]
    assert sorted(names, key=natural_key) == ["layers.1.q", "layers.2.k", "layers.2.q", "layers.10.q", "layers.11.q"]


def test_layers_in_natural_order_and_groups_sum_to_the_totals(tmp_path: Path) -> None:
    report = inspect_checkpoint(_mixed_checkpoint(tmp_path / "c"))
    assert [x.name for x in report.layers] == [f"model.layers.{i}.mlp.down_proj" for i in (0, 1, 2, 3, 10, 11)]
    by_scheme = {g.scheme: g for g in report.groups}
    assert set(by_scheme) == {"w4-g32-sym", "w4-g64-sym", "w8-ch-sym"}
    assert [g.scheme for g in report.groups] == ["w4-g64-sym", "w4-g32-sym", "w8-ch-sym"]  # fewest bits/w first
    assert (by_scheme["w4-g32-sym"].layers, by_scheme["w4-g64-sym"].layers, by_scheme["w8-ch-sym"].layers) == (2, 3, 1)
    assert sum(g.layers for g in report.groups) == len(report.layers) == 6
    assert sum(g.params for g in report.groups) == report.quantized_params == 6 * 32 * 128
    assert sum(g.bytes for g in report.groups) == report.quantized_bytes == sum(x.bytes for x in report.layers)
    # w4 g64: 4 bits + one bf16 scale per 64 weights; the group's bits/w is its bytes over its params
    assert by_scheme["w4-g64-sym"].bits_per_weight == pytest.approx(4 + 16 / 64, rel=1e-12)
    for group in report.groups:
        assert group.bits_per_weight == pytest.approx(8 * group.bytes / group.params, rel=1e-12)
    total_bits = sum(g.bits_per_weight * g.params for g in report.groups)
    assert total_bits / report.quantized_params == pytest.approx(report.avg_bits_per_weight, rel=1e-12)
    # the stored bytes are the headers' tensors (plus norm, weight_shape and the safetensors header)
    assert report.quantized_bytes < report.checkpoint_bytes
    data = json.loads(json.dumps(report.to_dict()))  # the old keys stay, the new ones are added
    assert {"layers", "quantized_params", "avg_bits_per_weight", "checkpoint_bytes", "compression_ratio"} <= set(data)
    assert sum(g["params"] for g in data["groups"]) == data["quantized_params"]
    assert data["layers"][4]["name"] == "model.layers.10.mlp.down_proj" and data["layers"][4]["bytes"] > 0


def test_rendered_layers_are_grouped_by_scheme_with_a_summary(tmp_path: Path) -> None:
    from rich.console import Console

    report = inspect_checkpoint(_mixed_checkpoint(tmp_path / "c"))
    layers, groups, _whole, engines = render_report(report).renderables
    assert layers.row_count == 6 and groups.row_count == 3 and engines.row_count == len(report.loads_in)
    console = Console(width=200, record=True)
    console.print(render_report(report))
    text = console.export_text()
    rows = [line for line in text.splitlines() if "down_proj" in line]
    names = [re.search(r"layers\.(\d+)\.", line).group(1) for line in rows]  # type: ignore[union-attr]
    assert names == ["1", "3", "11", "0", "10", "2"]  # by group (g64, g32, w8), natural order inside each
    total = next(line for line in text.splitlines() if "all quantized" in line)
    assert f"{report.quantized_params:,}" in total and mb_number(report.quantized_bytes) in total
    assert format_mb(report.checkpoint_bytes) in " ".join(text.split())


def test_sizes_are_megabytes() -> None:
    assert format_mb(116_493_000) == "116.5 MB"
    assert format_mb(41_200) == "0.0412 MB"
    assert format_mb(0) == "0.0 MB"
    assert format_mb(59_720_123, decimals=3) == "59.720 MB"


def test_cli_outputs_of_quantize_and_inspect_use_mb_never_mib(tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "q"
    args = ["quantize", str(tiny_model_dir), "-o", str(out), "--method", "rtn", "--group-size", "32"]
    code, quantize_out, err = run_cli(args, capsys)
    assert code == 0, err
    code, inspect_out, err = run_cli(["inspect", str(out), "--json", str(tmp_path / "i.json")], capsys)
    assert code == 0, err
    for text in (quantize_out, inspect_out):
        assert "MB" in text
        assert not re.search(r"\b[KMGT]iB\b", text), text
    report = json.loads((tmp_path / "i.json").read_text())
    assert sum(g["layers"] for g in report["groups"]) == len(report["layers"]) == 2 * 7
    layer_names = [x["name"] for x in report["layers"]]
    assert layer_names == sorted(layer_names, key=natural_key)
