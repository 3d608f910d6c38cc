"""`quantkit export` and `quantize --format`: bad input is one line, exit 2 and nothing under the output name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli

from quantkit.format.scheme import QuantScheme
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.pipeline import quantize_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    from helpers.tiny import build_word_tokenizer, tiny_llama

    path = tmp_path_factory.mktemp("bf16") / "model"
    model = tiny_llama(seed=0, bos_token_id=1, eos_token_id=2, intermediate_size=128)
    model.to(torch.bfloat16).save_pretrained(path)
    build_word_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(bf16_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "w4"
    config = QuantizeConfig.for_method("rtn", scheme=QuantScheme(bits=4, group_size=32), show_progress=False)
    quantize_model(str(bf16_model), config, out)
    return out


def _leftovers(parent: Path, name: str) -> list[str]:
    """The output, or a temporary sibling of it (``.name.tmp-<pid>``)."""
    return [p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.")]


def test_export_writes_gptq_and_refuses_to_overwrite(checkpoint, tmp_path, capsys):
    out = tmp_path / "gptq"
    code, stdout, err = run_cli(
        ["export", str(checkpoint), "--format", "gptq", "-o", str(out), "--json", str(tmp_path / "s.json")], capsys
    )
    assert code == 0, err
    assert "Exported gptq" in stdout and json.loads((tmp_path / "s.json").read_text())["tensor_types"]["int4-g32"] == 14
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"
    before = (out / "model.safetensors").stat().st_mtime_ns
    code, _, err = run_cli(["export", str(checkpoint), "--format", "gptq", "-o", str(out)], capsys)
    assert code == 2 and "exists; pass --force" in err
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gptq", "s.json"]  # no temporary left


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "onnx"], "unknown export format 'onnx'; use one of gptq, gguf"),
        (["--format", "gguf"], "a GGUF export is one file: name it with .gguf"),
    ],
)
def test_bad_format_arguments(checkpoint, tmp_path, capsys, args, message):
    code, _, err = run_cli(["export", str(checkpoint), *args, "-o", str(tmp_path / "out")], capsys)
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_quantkit_did_not_write_is_refused(checkpoint, bf16_model, tmp_path, capsys):
    code, _, err = run_cli(["export", str(bf16_model), "--format", "gptq", "-o", str(tmp_path / "o")], capsys)
    assert code == 2 and "not a quantized checkpoint" in err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for f in checkpoint.iterdir():
        if f.name != "quantkit_log.json":
            (foreign / f.name).write_bytes(f.read_bytes())
    code, _, err = run_cli(["export", str(foreign), "--format", "gguf", "-o", str(tmp_path / "o.gguf")], capsys)
    assert code == 2 and "was not written by quantkit" in err
    assert _leftovers(tmp_path, "o") == [] and _leftovers(tmp_path, "o.gguf") == []


def test_an_asymmetric_checkpoint_cannot_become_gptq(bf16_model, tmp_path, capsys):
    asym = tmp_path / "asym"
    config = QuantizeConfig.for_method("rtn", scheme=QuantScheme(group_size=32, symmetric=False), show_progress=False)
    quantize_model(str(bf16_model), config, asym)
    code, _, err = run_cli(["export", str(asym), "--format", "gptq", "-o", str(tmp_path / "g")], capsys)
    assert code == 2 and "cannot export to GPTQ" in err and "asymmetric" in err
    assert _leftovers(tmp_path, "g") == []


def test_quantize_with_formats_writes_the_exports_beside(bf16_model, tmp_path, capsys):
    out = tmp_path / "w4"
    args = ["quantize", str(bf16_model), "-o", str(out), "--method", "rtn", "--group-size", "32"]
    code, _, err = run_cli([*args, "--format", "gptq", "--format", "compressed-tensors"], capsys)
    assert code == 0, err
    assert (out / "model.safetensors").is_file() and (tmp_path / "w4-gptq" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w4", "w4-gptq"]


def test_quantize_refuses_an_export_its_scheme_cannot_hold_before_any_work(bf16_model, tmp_path, capsys):
    out = tmp_path / "w3"
    args = ["quantize", str(bf16_model), "-o", str(out), "--method", "rtn", "--bits", "3", "--group-size", "32"]
    code, _, err = run_cli([*args, "--format", "gptq"], capsys)
    assert code == 2 and "--format gptq cannot hold 14 layers exactly" in err and "3-bit" in err
    assert list(tmp_path.iterdir()) == []


def test_quantize_refuses_exports_of_a_float32_model(tiny_model_dir, tmp_path, capsys):
    args = ["quantize", str(tiny_model_dir), "-o", str(tmp_path / "q"), "--method", "rtn", "--group-size", "32"]
    code, _, err = run_cli([*args, "--format", "gptq"], capsys)
    assert code == 2 and "this model is float32" in err
    assert list(tmp_path.iterdir()) == []


def test_quantize_refuses_a_gguf_export_of_a_tokenizer_llama_cpp_cannot_take_before_any_work(
    bf16_model, tmp_path, capsys
):
    args = ["quantize", str(bf16_model), "-o", str(tmp_path / "q"), "--method", "rtn", "--group-size", "32"]
    code, _, err = run_cli([*args, "--format", "gguf"], capsys)
    assert code == 2 and "WordLevel tokenizer" in err
    assert list(tmp_path.iterdir()) == []
