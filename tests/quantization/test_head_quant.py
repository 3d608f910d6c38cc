"""``--quantize-head``: the head written as a quantized Linear in its own config group, loaded by quantkit's loader,
the runtime and transformers with the logits of its dequantized codes; GPTQ on the final hidden states beats
round-to-nearest on them; a tied head, an unknown spelling or a group that does not divide the hidden size is
refused in one line; inspect counts the head's bytes."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.cli import run_cli
from helpers.tiny import save_tiny_model
from safetensors.torch import load_file

from quantkit.errors import QuantkitError
from quantkit.format.loader import load_quantized_model
from quantkit.format.quantization_config import parse_quantization_config
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import read_linear
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods.head_quant import HeadQuantConfig, head_hessian, head_scheme, quantize_head
from quantkit.quantization.methods.rotation import RotationConfig
from quantkit.quantization.pipeline import quantize_model
from quantkit.quantization.solvers.gptq import hessian_weighted_error

SCHEME = QuantScheme(bits=4, group_size=32)
TOKENS = torch.tensor([[1, 5, 9, 17, 33, 65, 129, 200, 7, 3, 250, 11]])


def _quantize(model, calib, output, *algorithms, **fields):
    config = QuantizeConfig.for_method(
        "gptq", *algorithms, scheme=SCHEME, calibration_file=calib, show_progress=False, batch_size=2, **fields
    )
    quantize_model(str(model), config, output)
    return output


def test_head_spellings():
    assert head_scheme("none") is None
    int8 = head_scheme("int8")
    assert (int8.bits, int8.group_size, int8.symmetric, int8.act_order) == (8, -1, True, True)
    w4 = head_scheme("W4G64", "rtn")
    assert (w4.bits, w4.group_size, w4.act_order) == (4, 64, False)
    for bad in ("w5g64", "int4", "w4g0", "fp8"):
        with pytest.raises(QuantkitError, match="unknown head scheme"):
            HeadQuantConfig(bad)
    with pytest.raises(QuantkitError, match="unknown head solver"):
        HeadQuantConfig("int8", solver="awq")


def test_gptq_on_the_final_hidden_states_beats_rtn():
    """Correlated head inputs: GPTQ's Hessian-weighted error is below round-to-nearest's."""
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(32, 32, generator=gen)
    hidden = torch.randn(4, 64, 32, generator=gen) @ mix  # correlated channels
    head = torch.randn(96, 32, generator=gen)
    h = head_hessian(hidden, torch.ones(32), 1e-5)
    gptq = quantize_head(head, head_scheme("w4g16"), torch.float32, h).dequantize()
    rtn = quantize_head(head, head_scheme("w4g16", "rtn"), torch.float32, None).dequantize()
    assert hessian_weighted_error(head, gptq, h) < 0.8 * hessian_weighted_error(head, rtn, h)


@pytest.fixture(scope="module")
def head_checkpoints(tiny_model_dir, tiny_calib_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("head_quant")
    plain = _quantize(tiny_model_dir, tiny_calib_file, root / "plain")
    w4 = _quantize(tiny_model_dir, tiny_calib_file, root / "w4", HeadQuantConfig("w4g32"))
    int8 = _quantize(tiny_model_dir, tiny_calib_file, root / "int8", HeadQuantConfig("int8", solver="rtn"))
    return plain, w4, int8


def test_the_head_is_written_quantized_in_its_own_group(head_checkpoints):
    _, w4, int8 = head_checkpoints
    for path, bits, group in ((w4, 4, 32), (int8, 8, None)):
        tensors = load_file(str(path / "model.safetensors"))
        assert "lm_head.weight" not in tensors and "lm_head.weight_packed" in tensors
        qc = json.loads((path / "config.json").read_text())["quantization_config"]
        assert "lm_head" not in qc["ignore"]
        head_groups = [g for g in qc["config_groups"].values() if g["targets"] == ["lm_head"]]
        assert len(head_groups) == 1 and head_groups[0]["weights"]["num_bits"] == bits
        assert head_groups[0]["weights"]["group_size"] == group
        assert parse_quantization_config(qc).scheme_for("lm_head", ["Linear"]).bits == bits
        assert parse_quantization_config(qc).scheme_for("model.layers.0.mlp.down_proj", ["Linear"]).bits == 4
        log = json.loads((path / "quantkit_log.json").read_text())
        assert log["solvers"]["head_quant"]["scheme"] in ("w4g32", "int8")


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits.float()


def test_the_quantized_head_loads_with_its_dequantized_logits(head_checkpoints):
    """quantkit's loader computes with the dequantized codes (fp32): its head is exactly the stored codes
    dequantized; transformers (through compressed-tensors) gives equal logits; the runtime (the same dense head)
    within 1e-4 of the largest logit."""
    from helpers.runtime import engine_logits, small_engine
    from transformers import AutoModelForCausalLM

    _, w4, _ = head_checkpoints
    ours = load_quantized_model(w4)
    stored = load_file(str(w4 / "model.safetensors"))
    dequantized = read_linear(stored, "lm_head", head_scheme("w4g32")).dequantize(torch.float32)
    hidden = torch.randn(3, dequantized.shape[1])
    assert torch.allclose(ours.lm_head(hidden), hidden @ dequantized.T, atol=1e-5, rtol=1e-5)
    reference = _logits(ours)
    theirs = _logits(AutoModelForCausalLM.from_pretrained(str(w4), dtype=torch.float32).eval())
    assert torch.equal(reference, theirs), f"max |diff| {float((reference - theirs).abs().max()):.3g}"
    engine = small_engine(w4)
    head = engine.runner.model.lm_head  # on the CPU the runtime dequantizes once at load
    assert torch.equal(head.weight.float(), dequantized)
    got = engine_logits(engine, TOKENS[0].tolist())
    assert float((got - reference[0]).abs().max()) < 1e-4 * max(1.0, float(reference.abs().max()))


def test_a_quantized_head_costs_its_packed_bytes(head_checkpoints):
    from quantkit.format.inspect import inspect_checkpoint

    plain, w4, int8 = head_checkpoints
    reports = [inspect_checkpoint(p) for p in (plain, w4, int8)]
    vocab, hidden = 256, 64
    head_float = vocab * hidden * 4  # the tiny model stores float32
    head_w4 = vocab * hidden // 2 + vocab * (hidden // 32) * 4  # codes + fp32 scales
    head_int8 = vocab * hidden + vocab * 4
    assert reports[0].checkpoint_bytes - reports[1].checkpoint_bytes == pytest.approx(head_float - head_w4, abs=512)
    assert reports[0].checkpoint_bytes - reports[2].checkpoint_bytes == pytest.approx(head_float - head_int8, abs=512)
    assert "lm_head" in [layer.name for layer in reports[1].layers]


def test_a_tied_head_is_refused_in_one_line(tmp_path, tiny_calib_file, capsys):
    tied = save_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    out = tmp_path / "out"
    args = ["quantize", str(tied), "-o", str(out), "--calib", str(tiny_calib_file), "--group-size", "32"]
    capsys.readouterr()  # the tiny model's own save progress
    code, _, err = run_cli([*args, "--quantize-head", "int8"], capsys)
    assert code == 2 and not out.exists() and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert "--quantize-head needs an untied head" in line and "--rotate hadamard" in line


def test_a_group_that_does_not_divide_the_hidden_size_is_refused(tiny_model_dir, tiny_calib_file, tmp_path):
    with pytest.raises(QuantkitError, match="does not divide its 64 in-features"):
        _quantize(tiny_model_dir, tiny_calib_file, tmp_path / "bad", HeadQuantConfig("w4g48"))


def test_a_rotated_tied_head_is_quantized(tmp_path, tiny_calib_file):
    """A rotation unties the head; quantizing the untied head removes most of the untie's cost."""
    tied = save_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    out = _quantize(tied, tiny_calib_file, tmp_path / "rot", RotationConfig(), HeadQuantConfig("int8"))
    tensors = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight_packed" in tensors and "lm_head.weight" not in tensors
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    model = load_quantized_model(out)
    assert torch.isfinite(_logits(model)).all()


def test_a_refitted_head_is_the_one_quantized(tiny_model_dir, tiny_calib_file, tmp_path):
    """--refit-head runs first: the packed head is the refitted one quantized, not the source's."""
    from quantkit.quantization.methods.head_refit import HeadRefitConfig

    refit = _quantize(tiny_model_dir, tiny_calib_file, tmp_path / "refit", HeadRefitConfig())
    both = _quantize(tiny_model_dir, tiny_calib_file, tmp_path / "both", HeadRefitConfig(), HeadQuantConfig("int8"))
    refitted = load_file(str(refit / "model.safetensors"))["lm_head.weight"].float()
    source = load_file(str(tiny_model_dir / "model.safetensors"))["lm_head.weight"].float()
    packed = read_linear(load_file(str(both / "model.safetensors")), "lm_head", head_scheme("int8")).dequantize()
    to_refit, to_source = float((packed - refitted).abs().mean()), float((packed - source).abs().mean())
    assert to_refit < 0.5 * to_source
