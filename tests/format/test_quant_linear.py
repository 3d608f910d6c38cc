"""QuantLinear and load_quantized_model on tiny Llama checkpoints."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.checkpoint import save_quantized_model
from helpers.tiny import rtn_for_tests, tiny_llama
from safetensors.torch import load_file, save_file

from quantkit.errors import QuantkitError
from quantkit.format.files import is_quantized_checkpoint
from quantkit.format.loader import load_quantized_model
from quantkit.format.quant_linear import QuantLinear
from quantkit.format.quantization_config import build_quantization_config
from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.format.writer import INDEX_FILE, SINGLE_FILE

GROUPS = [
    (QuantScheme(bits=4, group_size=32, symmetric=True), ["Linear"]),
    (QuantScheme(bits=8, group_size=-1, symmetric=False), [r"re:.*down_proj$"]),
    (QuantScheme(bits=3, group_size=16, symmetric=False, act_order=True), [r"re:.*layers\.1\.self_attn\.v_proj$"]),
]
TOKENS = torch.tensor([[1, 17, 42, 99, 3, 250, 7, 64, 128, 5]])


def _quantize(model: torch.nn.Module, groups=GROUPS, ignore=("lm_head",)) -> tuple[dict, dict]:
    """RTN-quantize every targeted Linear; returns (quantized weights, quantization_config)."""
    from quantkit.format.quantization_config import parse_quantization_config

    cfg = build_quantization_config(list(groups), list(ignore))
    layout = parse_quantization_config(cfg)
    quantized = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and layout.scheme_for(name) is not None:
            quantized[name] = rtn_for_tests(module.weight, layout.scheme_for(name))
    return quantized, cfg


def _reference(model: torch.nn.Module, quantized: dict[str, QuantizedWeight], storage: torch.dtype) -> torch.nn.Module:
    """The float model as stored: float tensors rounded to ``storage``, Linears set to their dequantized weights."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(storage).float())
        for name, qw in quantized.items():
            ref.get_submodule(name).weight.copy_(qw.dequantize())
    return ref


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, dict, dict]:
    model = tiny_llama()
    quantized, cfg = _quantize(model)
    return model, quantized, cfg


# --- QuantLinear -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scheme",
    [QuantScheme(bits=4, group_size=128), QuantScheme(bits=3, group_size=64, symmetric=False, act_order=True)],
)
def test_quant_linear_forward_matches_dequantized(scheme: QuantScheme) -> None:
    weight = torch.randn(40, 576, generator=torch.Generator().manual_seed(1))  # g128: last group of 64
    qw = rtn_for_tests(weight, scheme)
    bias = torch.randn(40)
    layer = QuantLinear.from_quantized(qw, bias, scale_dtype=torch.bfloat16)
    assert layer.weight_packed.shape == (40, 576 * scheme.bits // 32)
    assert hasattr(layer, "weight_g_idx") == (scheme.act_order and not scheme.static_groups)
    x = torch.randn(3, 576)
    assert torch.allclose(layer(x), F.linear(x, qw.dequantize(), bias), atol=1e-5, rtol=0)
    assert torch.equal(layer.dense_weight(), qw.dequantize())
    half = layer(x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    assert torch.equal(layer.dense_weight(torch.bfloat16), qw.dequantize(torch.bfloat16))


def test_quant_linear_cache() -> None:
    qw = rtn_for_tests(torch.randn(8, 64), QuantScheme(bits=4, group_size=32))
    layer = QuantLinear.from_quantized(qw)
    layer.cache_weight = True
    x = torch.randn(2, 64)
    first = layer(x)
    assert layer._cached is not None
    assert torch.equal(layer(x), first)
    other = rtn_for_tests(torch.randn(8, 64), QuantScheme(bits=4, group_size=32))
    layer.load_state_dict(QuantLinear.from_quantized(other).state_dict())  # new weights drop the cache
    assert torch.equal(layer.dense_weight(), other.dequantize())


# --- load_quantized_model --------------------------------------------------------------------------


def test_load_matches_dequantized_float_model(tiny, tmp_path: Path) -> None:
    model, quantized, cfg = tiny
    out = save_quantized_model(model, quantized, cfg, tmp_path / "q", dtype=torch.bfloat16)
    assert is_quantized_checkpoint(out) and not is_quantized_checkpoint(tmp_path)
    loaded = load_quantized_model(out)
    layer = loaded.model.layers[1]
    assert isinstance(layer.mlp.down_proj, QuantLinear) and layer.mlp.down_proj.scheme == GROUPS[1][0]
    assert layer.self_attn.v_proj.scheme == GROUPS[2][0] and hasattr(layer.self_attn.v_proj, "weight_g_idx")
    assert isinstance(loaded.lm_head, torch.nn.Linear) and not isinstance(loaded.lm_head, QuantLinear)
    assert loaded.model.embed_tokens.weight.dtype == torch.float32
    assert layer.mlp.down_proj.weight_scale.dtype == torch.bfloat16  # scales stay as stored
    expected = _logits(_reference(model, quantized, torch.bfloat16))
    assert torch.allclose(_logits(loaded), expected, atol=1e-5, rtol=0)
    assert not torch.allclose(_logits(model), expected, atol=1e-3)  # quantization really changed the model


def test_sharded_checkpoint_loads_identically(tiny, tmp_path: Path) -> None:
    model, quantized, cfg = tiny
    single = save_quantized_model(model, quantized, cfg, tmp_path / "single")
    sharded = save_quantized_model(model, quantized, cfg, tmp_path / "sharded", max_shard_bytes=20_000)
    assert not (sharded / SINGLE_FILE).exists()
    weight_map = json.loads((sharded / INDEX_FILE).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 3
    assert set(weight_map) == set(load_file(str(single / SINGLE_FILE)))
    assert torch.equal(_logits(load_quantized_model(sharded)), _logits(load_quantized_model(single)))


def test_missing_tensor_is_a_clear_error(tiny, tmp_path: Path) -> None:
    model, quantized, cfg = tiny
    out = save_quantized_model(model, quantized, cfg, tmp_path / "q")
    tensors = load_file(str(out / SINGLE_FILE))
    del tensors["model.layers.0.mlp.down_proj.weight_zero_point"]
    save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    with pytest.raises(QuantkitError, match=r"missing tensors: model\.layers\.0\.mlp\.down_proj\.weight_zero_point"):
        load_quantized_model(out)


def test_config_targeting_other_layers_reports_unexpected(tiny, tmp_path: Path) -> None:
    model, quantized, cfg = tiny
    out = save_quantized_model(model, quantized, cfg, tmp_path / "q")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["ignore"].append(r"re:.*o_proj$")
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantkitError, match=r"unexpected tensors: .*o_proj\.weight_packed"):
        load_quantized_model(out)


def test_tied_embeddings(tmp_path: Path) -> None:
    model = tiny_llama(seed=1, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    quantized, cfg = _quantize(model)
    out = save_quantized_model(model, quantized, cfg, tmp_path / "q")
    assert "lm_head.weight" not in load_file(str(out / SINGLE_FILE))  # stored once
    loaded = load_quantized_model(out)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    expected = _logits(_reference(model, quantized, torch.bfloat16))
    assert torch.allclose(_logits(loaded), expected, atol=1e-5, rtol=0)


# --- transformers' own compressed-tensors integration -----------------------------------------------


def _hf_load(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_transformers_loads_symmetric_checkpoint(tmp_path: Path) -> None:
    model = tiny_llama(seed=2)
    groups = [
        (QuantScheme(bits=4, group_size=32), ["Linear"]),
        (QuantScheme(bits=8, group_size=-1), [r"re:.*down_proj$"]),
    ]
    quantized, cfg = _quantize(model, groups)
    # float32 storage: both loaders then compute exactly the same dense weights
    out = save_quantized_model(model, quantized, cfg, tmp_path / "q", dtype=torch.float32)
    ours, theirs = _logits(load_quantized_model(out)), _logits(_hf_load(out))
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)


# asymmetric schemes in transformers: tests/format/test_loader_matrix.py
