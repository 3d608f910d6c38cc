"""The coverage audit: every weight of a checkpoint with its kind, asked and written scheme and bytes, summed per
kind; the byte total is the shards' data bytes, an --ignore'd linear counts as float, a layout fallback shows the
scheme asked beside the one written, and inspect and quantize show it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers.checkpoint import data_bytes
from helpers.cli import run_cli
from helpers.tiny import rtn_for_tests

from quantkit.format.coverage import (
    ATTENTION,
    EMBEDDINGS,
    FLOAT,
    HEAD,
    MLP,
    OTHER,
    UNKNOWN,
    CoverageAudit,
    Intent,
    audit_checkpoint,
    kind_of,
)
from quantkit.format.files import RUN_LOG, shard_files
from quantkit.format.quantization_config import build_quantization_config
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import linear_tensors
from quantkit.format.writer import ShardedWriter

G32 = QuantScheme(bits=4, group_size=32)
LINEARS = {  # (out, in) of one block's linears, as the tiny Llama has them
    "self_attn.q_proj": (64, 64),
    "self_attn.k_proj": (32, 64),
    "self_attn.v_proj": (32, 64),
    "self_attn.o_proj": (64, 64),
    "mlp.gate_proj": (160, 64),
    "mlp.up_proj": (160, 64),
    "mlp.down_proj": (64, 160),
}
PER_BLOCK = sum(n * k for n, k in LINEARS.values())  # 43,008 params


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _write(path: Path, float_linear: str) -> dict[str, dict[str, torch.Tensor]]:
    """Two tiny blocks at w4 g32 but ``float_linear`` (kept as a bf16 weight), a KV cache's scales, norms (q_norm
    under self_attn too), an embedding and a head, over several shards; returns the tensors by module."""
    gen = torch.Generator().manual_seed(0)
    modules: dict[str, dict[str, torch.Tensor]] = {
        "model.embed_tokens": {"weight": torch.randn(256, 64, generator=gen).bfloat16()},
        "lm_head": {"weight": torch.randn(256, 64, generator=gen).bfloat16()},
        "model.norm": {"weight": torch.ones(64, dtype=torch.bfloat16)},
    }
    quantized = []
    for i in range(2):
        block = f"model.layers.{i}"
        for name, (n, k) in LINEARS.items():
            weight = torch.randn(n, k, generator=gen)
            full = f"{block}.{name}"
            if full == float_linear:
                modules[full] = {"weight": weight.bfloat16(), "bias": torch.zeros(n, dtype=torch.bfloat16)}
                continue
            packed = linear_tensors(full, rtn_for_tests(weight, G32), torch.bfloat16)
            modules[full] = {key.removeprefix(full + "."): t for key, t in packed.items()}
            quantized.append(full)
        modules[f"{block}.input_layernorm"] = {"weight": torch.ones(64, dtype=torch.bfloat16)}
        modules[f"{block}.self_attn.q_norm"] = {"weight": torch.ones(16, dtype=torch.bfloat16)}
        modules[f"{block}.self_attn"] = {"k_scale": torch.ones(1), "v_scale": torch.ones(1)}
    with ShardedWriter(path, max_shard_bytes=20_000) as writer:
        for module, tensors in modules.items():
            writer.add({f"{module}.{part}": t for part, t in tensors.items()})
        writer.finalize({}, [], quantization_config=build_quantization_config([(G32, quantized)], [float_linear]))
    return modules


def test_kinds_by_name() -> None:
    assert kind_of("model.layers.3.self_attn.q_proj").name == ATTENTION
    assert kind_of("model.layers.3.self_attn").name == ATTENTION  # a KV cache's k/v scales
    assert kind_of("model.layers.3.self_attn.k_norm").name == OTHER  # Qwen3: a norm under self_attn
    assert kind_of("model.layers.3.mlp.down_proj").name == MLP
    assert kind_of("model.embed_tokens").name == EMBEDDINGS and kind_of("lm_head").name == HEAD
    assert kind_of("model.layers.0.post_attention_layernorm").name == OTHER and kind_of("model.norm").name == OTHER
    assert kind_of("model.layers.0.mlp.down_proj").linears and not kind_of("lm_head").linears


def test_the_audit_sums_every_byte_of_the_shards_per_kind(tmp_path: Path) -> None:
    float_linear = "model.layers.1.mlp.up_proj"
    modules = _write(tmp_path / "ckpt", float_linear)
    assert len(shard_files(tmp_path / "ckpt")) > 1  # the index's shards are all read
    audit = audit_checkpoint(tmp_path / "ckpt")

    assert audit.total_bytes == data_bytes(tmp_path / "ckpt") == sum(_nbytes(t) for t in modules.values())
    kinds = {k.kind: k for k in audit.kinds}
    assert [k.kind for k in audit.kinds] == [ATTENTION, MLP, EMBEDDINGS, HEAD, OTHER]
    assert sum(k.bytes for k in audit.kinds) == audit.total_bytes
    assert sum(k.modules for k in audit.kinds) == len(modules) == 23
    assert sum(k.params for k in audit.kinds) == 2 * PER_BLOCK + 2 * 256 * 64 + 64 + 2 * (64 + 16)
    mlp = [m for m in modules if ".mlp." in m]
    attention = [m for m in modules if ".self_attn" in m and "norm" not in m]
    assert kinds[MLP].bytes == sum(_nbytes(modules[m]) for m in mlp)
    assert kinds[ATTENTION].bytes == sum(_nbytes(modules[m]) for m in attention)
    assert kinds[EMBEDDINGS].bytes == kinds[HEAD].bytes == 256 * 64 * 2
    assert kinds[OTHER].bytes == (64 + 2 * (64 + 16)) * 2
    assert kinds[MLP].schemes == {"w4-g32-sym": 5, FLOAT: 1} and kinds[MLP].float_linears == 1

    # the fraction: of the block linears' params (KV scales, norms, embedding and head aside)
    assert audit.linear_params == 2 * PER_BLOCK == 86_016
    assert audit.quantized_linear_params == 86_016 - 160 * 64
    assert audit.quantized_fraction == pytest.approx(75_776 / 86_016)
    rows = {row.name: row for row in audit.weights}
    assert rows["model.layers.0.self_attn"].params == 0 and not rows["model.layers.0.self_attn"].linear
    assert rows["model.layers.1.mlp.down_proj"].params == 64 * 160  # read from its weight_shape, not the packing
    # no run log: nothing says what was meant, and only the float linear stands out
    assert not audit.intent_recorded and rows[float_linear].intended == UNKNOWN
    assert [row.name for row in audit.exceptions()] == [float_linear]
    assert rows[float_linear].note == "written in float"
    assert CoverageAudit.from_dict(json.loads(json.dumps(audit.to_dict()))) == audit


def test_recorded_intents_name_the_reasons(tmp_path: Path) -> None:
    float_linear = "model.layers.0.self_attn.v_proj"
    _write(tmp_path / "ckpt", float_linear)
    intents = {
        float_linear: Intent(FLOAT, float_by="ignore"),
        "model.layers.1.mlp.down_proj": Intent("w4-g128-sym", layout="g128 -> g32"),
        "model.layers.0.mlp.gate_proj": Intent("w4-g32-sym", rtn_fallback=True),
        "model.layers.0.mlp.up_proj": Intent("w4-g32-sym"),
    }
    (tmp_path / "ckpt" / RUN_LOG).write_text(json.dumps({"coverage": {"intent_recorded": True, "weights": []}}))
    audit = audit_checkpoint(tmp_path / "ckpt", intents)
    rows = {row.name: row for row in audit.exceptions()}
    assert list(rows) == ["model.layers.0.mlp.gate_proj", float_linear, "model.layers.1.mlp.down_proj"]
    assert (rows[float_linear].intended, rows[float_linear].actual) == (FLOAT, FLOAT)
    assert rows[float_linear].note == "kept in float by --ignore"
    fallback = rows["model.layers.1.mlp.down_proj"]
    assert (fallback.intended, fallback.actual, fallback.note) == ("w4-g128-sym", "w4-g32-sym", "layout g128 -> g32")
    assert rows["model.layers.0.mlp.gate_proj"].note == "solved by RTN (GPTQ fell back)"
    kinds = {k.kind: k for k in audit.kinds}
    assert (kinds[MLP].layout_fallbacks, kinds[MLP].rtn_fallbacks, kinds[ATTENTION].float_linears) == (1, 1, 1)
    # what the log records is what inspect reads back
    (tmp_path / "ckpt" / RUN_LOG).write_text(json.dumps({"coverage": audit.to_dict()}))
    assert audit_checkpoint(tmp_path / "ckpt") == audit


def plain(text: str) -> str:
    """Rich output as words: table rules and borders gone, whitespace runs one space."""
    return " ".join(re.sub("[\u2500-\u257f]", " ", text).split())


def _quantize(model: Path, out: Path, capsys, *args: str) -> str:
    code, stdout, err = run_cli(["quantize", str(model), "-o", str(out), "--method", "rtn", *args], capsys)
    assert code == 0, err
    return plain(stdout)


def test_quantize_ends_with_the_audit_and_inspect_lists_what_differs(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """The default g128 falls back on every linear of the tiny model (64 and 160 in-features); the ignored
    down_proj of block 1 is float, asked so."""
    monkeypatch.setenv("COLUMNS", "250")
    out = tmp_path / "out"
    printed = _quantize(tiny_model_dir, out, capsys, "--ignore", r"layers\.1\.mlp\.down_proj")
    assert (
        "Coverage (every weight, per kind)" in printed and "quantized: 88.10% of the block linears' weights" in printed
    )
    assert "14 linears not written as asked (quantkit inspect lists them)" in printed

    log = json.loads((out / RUN_LOG).read_text())
    audit = audit_checkpoint(out)
    assert log["coverage"] == audit.to_dict() and audit.intent_recorded
    assert audit.total_bytes == data_bytes(out)
    assert sum(k.bytes for k in audit.kinds) == audit.total_bytes
    assert audit.linear_params == 86_016 and audit.quantized_linear_params == 86_016 - 64 * 160
    rows = {row.name: row for row in audit.weights}
    ignored = rows["model.layers.1.mlp.down_proj"]
    assert (ignored.intended, ignored.actual, ignored.float_by, ignored.linear) == (FLOAT, FLOAT, "ignore", True)
    down = rows["model.layers.0.mlp.down_proj"]
    assert (down.intended, down.actual, down.layout) == ("w4-g128-sym", "w4-g32-sym", "g128 -> g32")
    q = rows["model.layers.0.self_attn.q_proj"]
    assert (q.intended, q.actual, q.layout) == ("w4-g128-sym", "w4-g64-sym", "g128 -> g64")
    assert rows["lm_head"].intended == rows["lm_head"].actual == FLOAT and not rows["lm_head"].linear

    code, stdout, err = run_cli(["inspect", str(out), "--json", str(tmp_path / "i.json")], capsys)
    assert code == 0, err
    shown = plain(stdout)
    assert "Linears not written as asked" in shown and "kept in float by --ignore" in shown
    assert "model.layers.0.mlp.down_proj dense MLP w4-g128-sym w4-g32-sym layout g128 -> g32" in shown
    assert json.loads((tmp_path / "i.json").read_text())["coverage"] == audit.to_dict()
