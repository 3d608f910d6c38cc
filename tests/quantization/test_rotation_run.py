"""``--rotate hadamard`` in the layer-by-layer run: the same checkpoint as quantizing the rotated float model,
an untied head when the source ties it, resumable, and refused cleanly where it cannot fold."""

import json
from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli
from helpers.rotation import rotate_model
from helpers.tiny import save_tiny_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from quantkit.errors import QuantkitError
from quantkit.format.inspect import inspect_checkpoint
from quantkit.format.loader import load_quantized_model
from quantkit.format.scheme import QuantScheme
from quantkit.model.architectures import arch_for_model_type
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods.rotation import RotationConfig
from quantkit.quantization.pipeline import quantize_model

SCHEME = QuantScheme(bits=4, group_size=32)
HADAMARD = RotationConfig(kind="hadamard", seed=3)


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama that ties its head to its embedding, with norm weights away from one."""
    path = save_tiny_model(tmp_path_factory.mktemp("tied") / "model", tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
    model.save_pretrained(path)
    return path


def _quantize(model: Path, calib: Path | None, output: Path, rotation=HADAMARD, method="gptq", **kw):
    """``rotation`` RotationConfig("none"): the same run without a rotation."""
    config = QuantizeConfig.for_method(
        method, rotation, scheme=SCHEME, calibration_file=calib, show_progress=False, batch_size=2, **kw
    )
    return quantize_model(str(model), config, output)


def test_layer_by_layer_rotation_equals_quantizing_the_rotated_float_model(tied_model_dir, tiny_calib_file, tmp_path):
    rotated_dir = tmp_path / "rotated-float"
    model = AutoModelForCausalLM.from_pretrained(tied_model_dir, dtype=torch.float32)
    assert rotate_model(model, arch_for_model_type("llama"), HADAMARD)  # the head had to be untied
    model.save_pretrained(rotated_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (rotated_dir / name).write_bytes((tied_model_dir / name).read_bytes())

    streamed = _quantize(tied_model_dir, tiny_calib_file, tmp_path / "streamed").output
    in_memory = _quantize(rotated_dir, tiny_calib_file, tmp_path / "in-memory", rotation=RotationConfig("none")).output
    got, want = load_file(streamed / "model.safetensors"), load_file(in_memory / "model.safetensors")
    assert set(got) == set(want) and "lm_head.weight" in got
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    config = json.loads((streamed / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    log = json.loads((streamed / "quantkit_log.json").read_text())
    assert log["rotation"] == {"kind": "hadamard", "seed": 3, "rotate_heads": True, "untied_head": "lm_head.weight"}
    report = inspect_checkpoint(streamed)
    assert report.untied_head_bytes == 4 * 256 * 64  # the tiny model stores float32
    float_bits = 32 * report.total_params / (report.total_params - 256 * 64)
    assert report.model_bits_per_weight < float_bits


def test_rotated_checkpoint_keeps_the_function(tied_model_dir, tmp_path):
    """8-bit round-to-nearest: the rotated checkpoint is as close to the original as the unrotated one."""
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    reference = AutoModelForCausalLM.from_pretrained(tied_model_dir, dtype=torch.float32).eval()
    errors = {}
    for rotation in (RotationConfig("none"), HADAMARD):
        out = tmp_path / rotation.name
        config = QuantizeConfig.for_method(
            "rtn", rotation, scheme=QuantScheme(8, 32), show_progress=False, batch_size=2
        )
        quantize_model(str(tied_model_dir), config, out)
        with torch.no_grad():
            want = reference(ids).logits
            got = load_quantized_model(out)(ids).logits.float()
        errors[rotation.kind] = float((got - want).abs().max() / want.abs().max())
    assert errors["hadamard"] < 0.02 and errors["none"] < 0.02


def test_resume_with_a_rotation_gives_identical_bytes_and_checks_it(tied_model_dir, tiny_calib_file, tmp_path):
    whole = _quantize(tied_model_dir, tiny_calib_file, tmp_path / "whole").output

    def stop_after_first(index: int) -> None:
        if index == 0:
            raise KeyboardInterrupt

    resumed = tmp_path / "resumed"
    config = QuantizeConfig.for_method(
        "gptq", HADAMARD, scheme=SCHEME, calibration_file=tiny_calib_file, show_progress=False, batch_size=2
    )
    with pytest.raises(KeyboardInterrupt):
        quantize_model(str(tied_model_dir), config, resumed, on_block_done=stop_after_first)
    assert (tmp_path / "resumed.partial" / "outer.safetensors").is_file()
    with pytest.raises(QuantkitError, match="method, scheme or solver options differ"):
        _quantize(tied_model_dir, tiny_calib_file, resumed, rotation=RotationConfig("hadamard", seed=4), resume=True)
    assert _quantize(tied_model_dir, tiny_calib_file, resumed, resume=True).resumed_from == 1
    assert (whole / "model.safetensors").read_bytes() == (resumed / "model.safetensors").read_bytes()


def test_rotation_that_cannot_fold_is_refused_before_any_work(tied_model_dir, tmp_path, monkeypatch):
    from transformers.models.llama import modeling_llama

    class OffsetNorm(modeling_llama.LlamaRMSNorm):  # Gemma-style (1 + w): the weight cannot be absorbed
        def forward(self, hidden):
            normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return normed * (1.0 + self.weight)

    monkeypatch.setattr(modeling_llama, "LlamaRMSNorm", OffsetNorm)
    out = tmp_path / "out"
    with pytest.raises(QuantkitError, match="norm"):
        _quantize(tied_model_dir, None, out, method="rtn")
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_cli_rejects_an_unknown_rotation(tied_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli(
        ["quantize", str(tied_model_dir), "-o", str(out), "--method", "rtn", "--rotate", "qr"], capsys
    )
    assert code == 2 and "unknown rotation kind 'qr'" in " ".join(err.split())
    assert not out.exists()
