"""compressed-tensors pack-quantized tensors, quantization_config and the sharded writer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils.match import match_named_modules, match_targets
from helpers.checkpoint import save_quantized_model
from helpers.tiny import rtn_for_tests, tiny_llama
from safetensors import safe_open
from safetensors.torch import load_file

from quantkit.errors import QuantkitError
from quantkit.format.quantization_config import build_quantization_config, parse_quantization_config
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import linear_tensors, read_linear
from quantkit.format.writer import INDEX_FILE, SINGLE_FILE, ShardedWriter

N, K = 24, 576  # N*3/32 is not whole: zero points straddle words; K=576 with g128 leaves a short group


def _weight(n: int = N, k: int = K, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_linear_round_trip_bit_exact(bits: int, symmetric: bool, group_size: int) -> None:
    scheme = QuantScheme(bits=bits, group_size=group_size, symmetric=symmetric)
    qw = rtn_for_tests(_weight(), scheme)
    tensors = linear_tensors("model.proj", qw, torch.bfloat16)

    groups = math.ceil(K / (K if group_size == -1 else group_size))
    assert tensors["model.proj.weight_packed"].shape == (N, math.ceil(K * bits / 32))
    assert tensors["model.proj.weight_packed"].dtype == torch.int32
    assert tensors["model.proj.weight_scale"].shape == (N, groups)
    assert tensors["model.proj.weight_scale"].dtype == torch.bfloat16
    assert tensors["model.proj.weight_shape"].tolist() == [N, K]
    if symmetric:
        assert "model.proj.weight_zero_point" not in tensors
    else:  # packed along the output dim, like compressed-tensors' pack_to_int32(zp, b, packed_dim=0)
        zp = tensors["model.proj.weight_zero_point"]
        assert zp.dtype == torch.int32 and zp.shape == (math.ceil(N * bits / 32), groups)
    assert "model.proj.weight_g_idx" not in tensors

    back = read_linear(tensors, "model.proj", scheme)
    assert torch.equal(back.qweight, qw.qweight)
    assert torch.equal(back.scale, qw.scale)
    assert (back.zero is None) == symmetric
    if not symmetric:
        assert torch.equal(back.zero, qw.zero)
    assert torch.equal(back.dequantize(), qw.dequantize())


@pytest.mark.parametrize("static_groups", [False, True])
def test_act_order_round_trip(static_groups: bool) -> None:
    scheme = QuantScheme(bits=4, group_size=128, symmetric=False, act_order=True, static_groups=static_groups)
    qw = rtn_for_tests(_weight(), scheme, seed=3)
    tensors = linear_tensors("p", qw, torch.bfloat16)
    if static_groups:  # groups stay contiguous: nothing extra is stored
        assert "p.weight_g_idx" not in tensors
    else:
        assert tensors["p.weight_g_idx"].dtype == torch.int32
        assert torch.equal(tensors["p.weight_g_idx"], qw.g_idx)
        assert not torch.equal(qw.g_idx.long(), torch.arange(K) // 128)  # really permuted
    back = read_linear(tensors, "p", scheme)
    assert torch.equal(back.dequantize(), qw.dequantize())


def test_read_linear_reports_missing_and_malformed_tensors() -> None:
    scheme = QuantScheme(bits=4, group_size=64, symmetric=False)
    tensors = linear_tensors("x", rtn_for_tests(_weight(), scheme), torch.bfloat16)
    missing = {k: v for k, v in tensors.items() if k != "x.weight_zero_point"}
    with pytest.raises(QuantkitError, match=r"x\.weight_zero_point"):
        read_linear(missing, "x", scheme)
    with pytest.raises(QuantkitError, match=r"x\.weight_scale"):  # wrong group size for these tensors
        read_linear(tensors, "x", QuantScheme(bits=4, group_size=32, symmetric=False))


def test_linear_tensors_rejects_inconsistent_weight() -> None:
    qw = rtn_for_tests(_weight(), QuantScheme(bits=4, group_size=64))
    qw.scheme = QuantScheme(bits=4, group_size=64, symmetric=False)
    with pytest.raises(QuantkitError, match="zero points"):
        linear_tensors("x", qw, torch.bfloat16)


# --- quantization_config ---------------------------------------------------------------------------

MIXED = [
    (QuantScheme(bits=4, group_size=32, symmetric=True), ["Linear"]),
    (QuantScheme(bits=8, group_size=-1, symmetric=False), [r"re:.*mlp\.down_proj$"]),
    (QuantScheme(bits=3, group_size=64, symmetric=True, act_order=True, static_groups=True), ["re:.*self_attn.o"]),
]


def test_config_validates_with_compressed_tensors() -> None:
    cfg = build_quantization_config(MIXED, ["lm_head"])
    parsed = QuantizationConfig.model_validate(cfg)
    assert parsed.format == "pack-quantized" and parsed.quantization_status == "compressed"
    w0, w1, w2 = (parsed.config_groups[f"group_{i}"].weights for i in range(3))
    assert (w0.num_bits, w0.strategy, w0.group_size, w0.symmetric) == (4, "group", 32, True)
    assert (w1.num_bits, w1.strategy, w1.group_size, w1.symmetric) == (8, "channel", None, False)
    assert w2.actorder == "weight"
    assert parsed.ignore == ["lm_head"]
    json.dumps(cfg)  # config.json material


def test_config_round_trip() -> None:
    layout = parse_quantization_config(build_quantization_config(MIXED, ["lm_head"]))
    assert layout.schemes == [s for s, _ in MIXED]
    act_group = QuantScheme(bits=4, group_size=128, act_order=True)
    cfg = build_quantization_config([(act_group, ["Linear"])], [])
    assert cfg["config_groups"]["group_0"]["weights"]["actorder"] == "group"
    assert parse_quantization_config(cfg).scheme_for("a.b") == act_group


def test_scheme_for_matches_compressed_tensors_semantics() -> None:
    targets = [
        (QuantScheme(bits=4, group_size=32), ["Linear"]),
        (QuantScheme(bits=8, group_size=-1), [r"re:.*mlp\..*_proj$"]),
        (QuantScheme(bits=2, group_size=32), ["model.layers.1.mlp.up_proj", r"re:.*layers\.1\..*"]),
        (QuantScheme(bits=3, group_size=32), ["re:mlp"]),  # re.match is anchored at the start: matches nothing
    ]
    ignore = [r"re:.*k_proj", "lm_head"]
    cfg = build_quantization_config(targets, ignore)
    layout = parse_quantization_config(cfg)

    model = tiny_llama()
    ct_config = QuantizationConfig.model_validate(cfg)
    target_to_scheme = {t: s for s in ct_config.config_groups.values() for t in s.targets}
    expected: dict[str, int | None] = dict.fromkeys(
        (n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)), None
    )
    for name, module in match_named_modules(model, target_to_scheme, ct_config.ignore):
        if isinstance(module, torch.nn.Linear):
            expected[name] = target_to_scheme[match_targets(name, module, target_to_scheme)[0]].weights.num_bits

    ours = {}
    for name in expected:
        scheme = layout.scheme_for(name, [c.__name__ for c in type(model.get_submodule(name)).__mro__])
        ours[name] = scheme.bits if scheme else None
    assert ours == expected
    # spot checks of the precedence rules
    assert ours["model.layers.1.mlp.up_proj"] == 2  # exact name beats regexes
    assert ours["model.layers.1.mlp.down_proj"] == 2  # regexes in sorted order: 're:.*layers' < 're:.*mlp'
    assert ours["model.layers.0.mlp.down_proj"] == 8  # regex beats class
    assert ours["model.layers.0.self_attn.q_proj"] == 4  # class only
    assert ours["model.layers.0.self_attn.k_proj"] is None and ours["lm_head"] is None  # ignored


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c.update(format="int-quantized"), "format"),
        (lambda c: c.update(quant_method="gptq"), "quant_method"),
        (lambda c: c["config_groups"]["group_0"]["weights"].update(type="float", num_bits=2), "2-bit float"),
        (lambda c: c["config_groups"]["group_0"]["weights"].update(type="mxint"), "type"),
        (lambda c: c["config_groups"]["group_0"].update(input_activations={"symmetric": False}), "activations"),
        (lambda c: c["config_groups"]["group_0"].update(output_activations={"num_bits": 8}), "output"),
        (lambda c: c.update(kv_cache_scheme={"num_bits": 4, "type": "int"}), "kv"),
        (lambda c: c["config_groups"]["group_0"]["weights"].update(strategy="tensor", group_size=None), "strategy"),
        (lambda c: c.update(config_groups={"W4A16": ["Linear"]}), "preset"),
    ],
)
def test_parse_rejects_unsupported_configs(mutate, message: str) -> None:
    cfg = build_quantization_config([(QuantScheme(), ["Linear"])], [])
    mutate(cfg)
    with pytest.raises(QuantkitError, match=message):
        parse_quantization_config(cfg)


# --- compressed-tensors decompresses what we write -------------------------------------------------


def test_compressed_tensors_decompresses_our_checkpoint(tmp_path: Path) -> None:
    model = tiny_llama()
    groups = [
        (QuantScheme(bits=4, group_size=32, symmetric=True), ["Linear"]),
        (QuantScheme(bits=8, group_size=-1, symmetric=False), [r"re:.*down_proj$"]),
        (QuantScheme(bits=4, group_size=32, symmetric=False), [r"re:.*layers\.1\.self_attn\.[qv]_proj$"]),
        (QuantScheme(bits=8, group_size=64, symmetric=True), [r"re:.*gate_proj$"]),
    ]
    cfg = build_quantization_config(groups, ["lm_head"])
    layout = parse_quantization_config(cfg)
    quantized = {}
    for name, module in model.named_modules():
        scheme = layout.scheme_for(name, [c.__name__ for c in type(module).__mro__])
        if scheme is not None:
            quantized[name] = rtn_for_tests(module.weight, scheme)
    assert {q.scheme.bits for q in quantized.values()} == {4, 8}
    assert {q.scheme.symmetric for q in quantized.values()} == {True, False}
    out = save_quantized_model(model, quantized, cfg, tmp_path / "ckpt", dtype=torch.bfloat16)

    stored = load_file(str(out / SINGLE_FILE))
    ct_config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    target_to_scheme = {t: s for s in ct_config.config_groups.values() for t in s.targets}
    for name, qw in quantized.items():
        ct_scheme = target_to_scheme[match_targets(name, model.get_submodule(name), target_to_scheme)[0]]
        local = {k.removeprefix(name + "."): v for k, v in stored.items() if k.startswith(name + ".")}
        dense = PackedQuantizationCompressor.decompress(local, ct_scheme)["weight"]
        assert dense.dtype == torch.bfloat16
        assert torch.equal(dense, qw.dequantize(torch.bfloat16)), name


# --- ShardedWriter ---------------------------------------------------------------------------------


def _tensors(count: int, size: int = 256) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((size,), float(i)) for i in range(count)}


def test_writer_single_shard(tmp_path: Path) -> None:
    final = tmp_path / "out"
    extra = tmp_path / "tokenizer.json"
    extra.write_text("{}")
    with ShardedWriter(final) as writer:
        writer.add(_tensors(3))
        writer.finalize({"model_type": "llama"}, [extra], quantization_config={"quant_method": "x"})
    assert sorted(p.name for p in final.iterdir()) == ["config.json", SINGLE_FILE, "tokenizer.json"]
    assert json.loads((final / "config.json").read_text())["quantization_config"] == {"quant_method": "x"}
    with safe_open(str(final / SINGLE_FILE), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert not list(tmp_path.glob("*.tmp-*"))


def test_writer_shards_and_index(tmp_path: Path) -> None:
    tensors = _tensors(5)  # 1 KiB each
    final = tmp_path / "out"
    with ShardedWriter(final, max_shard_bytes=2500) as writer:
        writer.add(dict(list(tensors.items())[:2]))
        writer.add(dict(list(tensors.items())[2:]))
        writer.finalize({}, [])
    index = json.loads((final / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == 5 * 1024
    names = sorted(set(index["weight_map"].values()))
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for name, file in index["weight_map"].items():
        assert torch.equal(load_file(str(final / file))[name], tensors[name])


def test_writer_refuses_existing_dir_and_leaves_it_untouched(tmp_path: Path) -> None:
    final = tmp_path / "out"
    final.mkdir()
    (final / "keep.txt").write_text("mine")
    with pytest.raises(QuantkitError, match="already exists"):
        ShardedWriter(final)
    assert [p.name for p in final.iterdir()] == ["keep.txt"]
    assert not list(tmp_path.glob("*.tmp-*"))


def test_writer_overwrite_replaces_only_when_complete(tmp_path: Path) -> None:
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), ShardedWriter(final, overwrite=True) as writer:
        writer.add(_tensors(1))
        raise RuntimeError("boom")
    assert [p.name for p in final.iterdir()] == ["old.txt"]  # failed write: old dir intact
    with ShardedWriter(final, overwrite=True) as writer:
        writer.add(_tensors(1))
        writer.finalize({}, [])
    assert sorted(p.name for p in final.iterdir()) == ["config.json", SINGLE_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_writer_exception_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with pytest.raises(ValueError, match="boom"), ShardedWriter(final, max_shard_bytes=1000) as writer:
        writer.add(_tensors(4))  # flushes shards into the temp dir
        assert writer.tmp_dir.exists() and any(writer.tmp_dir.iterdir())
        raise ValueError("boom")
    assert list(tmp_path.iterdir()) == []


def test_writer_without_finalize_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(QuantkitError, match="finalize"), ShardedWriter(tmp_path / "out") as writer:
        writer.add(_tensors(1))
    assert list(tmp_path.iterdir()) == []
