"""GPTQ v1 export: tensors decoded by an independent GPTQ decoder (written here from the format, reading bits and
group sizes from config.json as a loader would) equal the checkpoint's own weights bit for bit; config.json and
quantize_config.json say what GPTQ stacks read; everything GPTQ v1 cannot hold is refused before anything is
written. A GPTQ stack quantkit did not write loads the export in tools/check_gptq_export.py (gptqmodel, not in CI)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers.tiny import build_word_tokenizer, rtn_for_tests, tiny_llama
from safetensors import safe_open

from quantkit.errors import QuantkitError
from quantkit.export.gptq import check_gptq, module_patterns, write_gptq
from quantkit.export.source import open_export_source
from quantkit.format.files import RUN_LOG
from quantkit.format.quantization_config import build_quantization_config
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import linear_tensors
from quantkit.format.writer import SINGLE_FILE
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.pipeline import quantize_model

pytestmark = pytest.mark.slow
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
W4G32 = QuantScheme(bits=4, group_size=32)
W8CH = QuantScheme(bits=8, group_size=-1)
W8G64 = QuantScheme(bits=8, group_size=64)


# --------------------------------------------------------------------------------------------------
# An independent GPTQ v1 reader: the format as loaders implement it, nothing from quantkit
# --------------------------------------------------------------------------------------------------


def read_export(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})  # noqa: SIM118
    return tensors


def unpack_fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] int32 words -> [R, 32/b, C] unsigned b-bit fields, field i at bits [i*b, (i+1)*b)."""
    per_word = 32 // bits
    shifts = (torch.arange(per_word) * bits).view(1, per_word, 1)
    return (words.to(torch.int64).unsqueeze(1) >> shifts) & ((1 << bits) - 1)


def dequantize_gptq(tensors: dict[str, torch.Tensor], prefix: str, bits: int, group_size: int) -> torch.Tensor:
    """[N, K] float32 weight of a GPTQ v1 linear: (q - (qzeros + 1)) * scales[g_idx]."""
    qweight, qzeros = tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"]
    scales, g_idx = tensors[f"{prefix}.scales"], tensors[f"{prefix}.g_idx"]
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    groups = 1 if group_size == -1 else k // group_size
    assert qweight.dtype == qzeros.dtype == g_idx.dtype == torch.int32 and scales.dtype == torch.float16
    assert tuple(qzeros.shape) == (groups, n * bits // 32) and tuple(scales.shape) == (groups, n)
    assert torch.equal(g_idx.long(), torch.arange(k) // (k if group_size == -1 else group_size))
    codes = unpack_fields(qweight, bits).reshape(k, n)  # packed along K
    zeros = unpack_fields(qzeros, bits).transpose(1, 2).reshape(groups, n) + 1  # packed along N; v1 stores zero - 1
    rows = g_idx.long()
    return ((codes - zeros[rows]).float() * scales.float()[rows]).t()


def resolve(config: dict, module: str) -> tuple[int, int] | None:
    """(bits, group_size) a GPTQModel/vLLM loader gives ``module``: dynamic rules by re.match, first match wins;
    None when a ``-:`` rule leaves it in float."""
    for key, override in (config.get("dynamic") or {}).items():
        if key.startswith("-:") and re.match(key[2:], module):
            return None
        if not key.startswith("-:") and re.match(key.removeprefix("+:"), module):
            return override.get("bits", config["bits"]), override.get("group_size", config["group_size"])
    return config["bits"], config["group_size"]


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp16_model(tmp_path_factory) -> Path:
    """A tiny float16 Llama (scales stored in float16: exact), biased attention, intermediate 128, a chat template."""
    path = tmp_path_factory.mktemp("fp16") / "model"
    model = tiny_llama(seed=0, bos_token_id=1, eos_token_id=2, intermediate_size=128, attention_bias=True)
    model.to(torch.float16).save_pretrained(path)
    build_word_tokenizer().save_pretrained(path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def quantize(model: Path, out: Path, scheme: QuantScheme, planned: dict | None = None) -> Path:
    config = QuantizeConfig.for_method("rtn", scheme=scheme, planned=planned, show_progress=False)
    quantize_model(str(model), config, out)
    return out


def mixed_plan() -> dict[str, QuantScheme | None]:
    """W4 g32 base; layer 1's MLP int8 per-channel, layer 0's down_proj int8 g64, layer 0's q/k/v in float."""
    plan: dict[str, QuantScheme | None] = {f"model.layers.{i}.{name}": W4G32 for i in range(2) for name in LINEARS}
    plan.update({f"model.layers.1.mlp.{name}": W8CH for name in ("gate_proj", "up_proj", "down_proj")})
    plan["model.layers.0.mlp.down_proj"] = W8G64
    plan.update({f"model.layers.0.self_attn.{name}": None for name in ("q_proj", "k_proj", "v_proj")})
    return plan


def export(checkpoint: Path, out: Path, **kwargs: int):
    out.mkdir()
    return write_gptq(open_export_source(checkpoint), out, **kwargs)


def assert_bit_exact(checkpoint: Path, exported: Path) -> dict:
    """Every quantized linear decodes (with the bits/group size the config gives it) to the source's weight."""
    config = json.loads((exported / "config.json").read_text())["quantization_config"]
    tensors = read_export(exported)
    seen = 0
    for prefix, qw in open_export_source(checkpoint).quantized_weights():
        resolved = resolve(config, prefix)
        assert resolved == (qw.scheme.bits, qw.scheme.group_size), prefix
        assert torch.equal(dequantize_gptq(tensors, prefix, *resolved), qw.dequantize()), prefix
        seen += 1
    assert seen == sum(k.endswith(".qweight") for k in tensors)
    return config


# --------------------------------------------------------------------------------------------------
# Uniform schemes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scheme",
    [W4G32, QuantScheme(bits=4, group_size=-1), W8G64, W8CH, QuantScheme(bits=2, group_size=32)],
    ids=lambda s: s.name,
)
def test_uniform_export_is_bit_exact(fp16_model: Path, tmp_path: Path, scheme: QuantScheme) -> None:
    checkpoint = quantize(fp16_model, tmp_path / "ckpt", scheme)
    summary = export(checkpoint, tmp_path / "gptq")
    config = assert_bit_exact(checkpoint, tmp_path / "gptq")

    assert config == json.loads((tmp_path / "gptq" / "quantize_config.json").read_text())
    assert (config["quant_method"], config["bits"], config["group_size"]) == ("gptq", scheme.bits, scheme.group_size)
    assert (config["desc_act"], config["sym"], config["lm_head"]) == (False, True, False)
    assert config["checkpoint_format"] == config["format"] == "gptq"
    assert "dynamic" not in config and "modules_in_block_to_quantize" not in config
    label = f"int{scheme.bits}-" + ("ch" if scheme.per_channel else f"g{scheme.group_size}")
    assert summary.format == "gptq" and summary.tensor_types[label] == 14
    assert summary.bytes == sum(f.stat().st_size for f in (tmp_path / "gptq").iterdir())


def test_export_keeps_dense_tensors_biases_config_and_side_files(fp16_model: Path, tmp_path: Path) -> None:
    checkpoint = quantize(fp16_model, tmp_path / "ckpt", W4G32)
    export(checkpoint, tmp_path / "gptq")
    out = tmp_path / "gptq"
    names = {p.name for p in out.iterdir()}
    assert {SINGLE_FILE, "config.json", "quantize_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert {"generation_config.json", "chat_template.jinja"} <= names
    assert RUN_LOG not in names  # the export is not a quantkit checkpoint: `export` must not take it as one
    assert (out / "chat_template.jinja").read_text() == TEMPLATE

    source_config = json.loads((checkpoint / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == {
        k: v for k, v in source_config.items() if k != "quantization_config"
    }
    exported, stored = read_export(out), read_export(checkpoint)
    dense = {k: v for k, v in stored.items() if not k.rpartition(".")[2].startswith("weight_")}
    assert "model.layers.0.self_attn.q_proj.bias" in dense and "lm_head.weight" in dense
    for key, tensor in dense.items():  # embeddings, norms, head and biases: same dtype, same values
        assert exported[key].dtype == tensor.dtype == torch.float16 and torch.equal(exported[key], tensor), key
    suffixes = ("qweight", "qzeros", "scales", "g_idx")
    packed = {f"model.layers.{i}.{name}.{suffix}" for i in range(2) for name in LINEARS for suffix in suffixes}
    assert set(exported) - set(dense) == packed


def test_shards_and_index(fp16_model: Path, tmp_path: Path) -> None:
    checkpoint = quantize(fp16_model, tmp_path / "ckpt", W4G32)
    export(checkpoint, tmp_path / "gptq", max_shard_bytes=20_000)
    shards = sorted((tmp_path / "gptq").glob("*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "gptq" / SINGLE_FILE).exists()
    index = json.loads((tmp_path / "gptq" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(read_export(tmp_path / "gptq"))
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert_bit_exact(checkpoint, tmp_path / "gptq")


# --------------------------------------------------------------------------------------------------
# Mixed plans: GPTQModel's `dynamic` rules
# --------------------------------------------------------------------------------------------------


def test_mixed_plan_uses_dynamic_rules(fp16_model: Path, tmp_path: Path) -> None:
    checkpoint = quantize(fp16_model, tmp_path / "ckpt", W4G32, planned=mixed_plan())
    summary = export(checkpoint, tmp_path / "gptq")
    config = assert_bit_exact(checkpoint, tmp_path / "gptq")  # each layer decoded with the bits dynamic gives it

    assert (config["bits"], config["group_size"]) == (4, 32)  # the most common scheme is the base
    assert summary.tensor_types["int4-g32"] == 7
    assert (summary.tensor_types["int8-ch"], summary.tensor_types["int8-g64"]) == (3, 1)
    floats = [f"model.layers.0.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")]
    for name in floats:
        assert resolve(config, name) is None
    exported = read_export(tmp_path / "gptq")
    assert all(exported[f"{n}.weight"].dtype == torch.float16 for n in floats)
    # vLLM resolves rules on its fused modules: they must agree with their members
    assert resolve(config, "model.layers.0.self_attn.qkv_proj") is None
    assert resolve(config, "model.layers.1.mlp.gate_up_proj") == (8, -1)
    assert resolve(config, "model.layers.0.mlp.gate_up_proj") == (4, 32)
    assert resolve(config, "model.layers.1.self_attn.qkv_proj") == (4, 32)
    # transformers/optimum ignore `dynamic`: they skip what this list leaves out
    quantized = set(config["modules_in_block_to_quantize"][0])
    assert quantized == {k.removesuffix(".qweight") for k in exported if k.endswith(".qweight")}
    assert any("mixed plan" in note for note in summary.notes)


def test_module_patterns_match_exactly_their_modules() -> None:
    names = [f"model.layers.{i}.mlp.{n}" for i in (1, 3) for n in ("gate_proj", "up_proj")]
    names += ["model.layers.3.self_attn.q_proj", "lm_head"]
    patterns = module_patterns(names)

    def matched(name: str) -> bool:
        return any(re.match(p, name) for p in patterns)

    assert all(matched(n) for n in names)
    assert matched("model.layers.1.mlp.gate_up_proj") and matched("model.layers.3.mlp.gate_up_proj")
    for other in (
        "model.layers.11.mlp.gate_proj",  # layer 1's pattern must not reach layer 11
        "model.layers.2.mlp.up_proj",
        "model.layers.1.mlp.down_proj",
        "model.layers.3.self_attn.k_proj",
        "model.layers.3.self_attn.qkv_proj",  # q alone is not the whole fused group
        "lm_head_extra",
    ):
        assert not matched(other), other
    assert len(patterns) == 3  # layers 1 and 3 share one pattern


# --------------------------------------------------------------------------------------------------
# Refusals: one line, before anything is written
# --------------------------------------------------------------------------------------------------


def synthetic_checkpoint(path: Path, scheme: QuantScheme, k: int = 128, scale_dtype=torch.float16) -> Path:
    """A one-linear quantkit checkpoint written directly (layouts the pipeline may refuse to produce)."""
    path.mkdir()
    weight = torch.randn(64, k, generator=torch.Generator().manual_seed(0)) * 0.02
    qw = rtn_for_tests(weight, scheme, scale_dtype=scale_dtype, seed=1)
    tensors = linear_tensors("model.layers.0.mlp.down_proj", qw, scale_dtype)
    from safetensors.torch import save_file

    save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
    qc = build_quantization_config([(scheme, ["Linear"])], ["lm_head"])
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    (path / RUN_LOG).write_text("{}")
    return path


@pytest.mark.parametrize(
    ("scheme", "k", "scale_dtype", "message"),
    [
        (QuantScheme(bits=4, group_size=32, symmetric=False), 128, torch.float16, "held: asymmetric.*symmetric 2, 4"),
        (QuantScheme(bits=3, group_size=32), 128, torch.float16, "cannot be held: 3-bit weights"),
        (QuantScheme(bits=4, group_size=32, act_order=True), 128, torch.float16, "dynamic act-order.*desc_act: false"),
        (QuantScheme(bits=4, group_size=64), 96, torch.float16, "group size 64 does not divide its 96 in-features"),
        (QuantScheme(bits=4, group_size=32), 128, torch.float32, r"float16 cannot represent exactly \(\d+ in model"),
    ],
    ids=["asym", "3bit", "act-order-g_idx", "short-group", "fp16-inexact-scales"],
)
def test_refusals_write_nothing(
    tmp_path: Path, scheme: QuantScheme, k: int, scale_dtype: torch.dtype, message: str
) -> None:
    source = open_export_source(synthetic_checkpoint(tmp_path / "ckpt", scheme, k, scale_dtype))
    with pytest.raises(QuantkitError, match=message) as error:
        check_gptq(source)
    text = str(error.value)
    assert "\n" not in text and "model.layers.0.mlp.down_proj" in text and scheme.name in text
    out = tmp_path / "gptq"
    out.mkdir()
    with pytest.raises(QuantkitError, match=message):
        write_gptq(source, out)
    assert list(out.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "gptq"]


def test_float_scales_from_the_pipeline_are_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The float32 tiny model stores float32 scales: most are not float16 values."""
    checkpoint = quantize(tiny_model_dir, tmp_path / "ckpt", W4G32)
    with pytest.raises(QuantkitError, match="scales that float16 cannot represent exactly"):
        check_gptq(open_export_source(checkpoint))


def test_a_float_model_is_not_exported(fp16_model: Path, tmp_path: Path) -> None:
    with pytest.raises(QuantkitError, match="not a quantized checkpoint"):
        open_export_source(fp16_model)
    checkpoint = quantize(fp16_model, tmp_path / "ckpt", W4G32)
    (checkpoint / RUN_LOG).unlink()  # a pack-quantized checkpoint quantkit did not write
    with pytest.raises(QuantkitError, match="not written by quantkit"):
        open_export_source(checkpoint)
