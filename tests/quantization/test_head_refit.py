"""``--refit-head``: the least-squares map folded into the head undoes a linear distortion of the final hidden
states, leaves an undistorted head alone, lowers the quantized model's logit error on its calibration windows in
a real run (alone and after a rotation), resumes to the same bytes, and is refused where the head is tied."""

import json

import pytest
import torch
from helpers.cli import run_cli
from helpers.tiny import logit_error, save_tiny_model
from safetensors.torch import load_file

from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantScheme
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods.head_refit import HeadRefitConfig
from quantkit.quantization.methods.rotation import RotationConfig
from quantkit.quantization.pipeline import quantize_model
from quantkit.quantization.solvers.head_refit import final_hidden, refit_head

SCHEME = QuantScheme(bits=3, group_size=32)
EPS = 1e-5
RIDGE = HeadRefitConfig().ridge


def _streams(seed: int, n: int = 6, tokens: int = 40, hidden: int = 24) -> torch.Tensor:
    return torch.randn(n, tokens, hidden, generator=torch.Generator().manual_seed(seed))


def test_an_undistorted_stream_leaves_the_head_alone() -> None:
    stream, head, norm = _streams(0), torch.randn(50, 24), torch.rand(24) + 0.5
    refitted = refit_head(head, stream, stream, norm, EPS, RIDGE)
    assert float((refitted - head).abs().max()) < 2e-3 * float(head.abs().max())  # only the ridge's shrinkage


def test_a_rotated_stream_is_read_as_the_original() -> None:
    """The quantized stream is the float one turned by an orthogonal matrix: the refitted head on it gives the
    float logits (RMSNorm commutes with the rotation when the norm weight is one)."""
    reference, head, ones = _streams(1), torch.randn(50, 24), torch.ones(24)
    rotation, _ = torch.linalg.qr(torch.randn(24, 24, generator=torch.Generator().manual_seed(2)))
    quantized = reference @ rotation
    refitted = refit_head(head, quantized, reference, ones, EPS, 1e-9)
    expected = final_hidden(reference, ones, EPS) @ head.T
    got = final_hidden(quantized, ones, EPS) @ refitted.T
    assert float((got - expected).abs().max()) < 1e-4 * float(expected.abs().max())
    plain = final_hidden(quantized, ones, EPS) @ head.T
    assert float((plain - expected).abs().max()) > 0.1 * float(expected.abs().max())  # the head alone is wrong


def test_streams_must_pair_tokens() -> None:
    with pytest.raises(ValueError, match="must pair tokens"):
        refit_head(torch.randn(5, 24), _streams(0), _streams(0, n=5), torch.ones(24), EPS, RIDGE)


def _quantize(model, calib, output, *algorithms, on_block_done=None, **fields):
    config = QuantizeConfig.for_method(
        "gptq", *algorithms, scheme=SCHEME, calibration_file=calib, show_progress=False, batch_size=2, **fields
    )
    return quantize_model(str(model), config, output, on_block_done=on_block_done)


@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
def test_refit_lowers_the_logit_error_on_the_calibration_windows(tiny_model_dir, tiny_calib_file, tmp_path, rotate):
    rotation = RotationConfig("hadamard" if rotate else "none")
    plain, refit = tmp_path / "plain", tmp_path / "refit"
    _quantize(tiny_model_dir, tiny_calib_file, plain, rotation)
    _quantize(tiny_model_dir, tiny_calib_file, refit, rotation, HeadRefitConfig())
    heads = [load_file(str(d / "model.safetensors"))["lm_head.weight"] for d in (plain, refit)]
    assert heads[0].shape == heads[1].shape and heads[0].dtype == heads[1].dtype
    assert not torch.equal(heads[0], heads[1])
    assert json.loads((refit / "quantkit_log.json").read_text())["solvers"]["head_refit"] == {"ridge": 1e-4}
    before = logit_error(tiny_model_dir, plain, tiny_calib_file)
    after = logit_error(tiny_model_dir, refit, tiny_calib_file)
    assert after < 0.9 * before


def test_a_refit_run_resumes_to_the_same_bytes(tiny_model_dir, tiny_calib_file, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _quantize(tiny_model_dir, tiny_calib_file, whole, HeadRefitConfig())

    def stop_after_last(index: int) -> None:  # every block done, the checkpoint not yet written
        if index == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _quantize(tiny_model_dir, tiny_calib_file, resumed, HeadRefitConfig(), on_block_done=stop_after_last)
    with pytest.raises(QuantkitError, match="method, scheme or solver options differ"):
        _quantize(tiny_model_dir, tiny_calib_file, resumed, resume=True)  # the same run without the refit
    _quantize(tiny_model_dir, tiny_calib_file, resumed, HeadRefitConfig(), resume=True)
    for name in ("model.safetensors", "quantkit_log.json"):
        assert (whole / name).read_bytes() == (resumed / name).read_bytes(), name


def test_cli_refuses_a_refit_of_a_tied_head(tmp_path, tiny_calib_file, capsys):
    tied = save_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    out = tmp_path / "out"
    args = [
        "quantize",
        str(tied),
        "-o",
        str(out),
        "--calib",
        str(tiny_calib_file),
        "--group-size",
        "32",
        "--refit-head",
    ]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and not out.exists()
    assert "--refit-head needs an untied head" in err and "--rotate hadamard" in err


def test_the_free_space_check_counts_the_float_activations(tiny_model_dir, tiny_calib_file, tmp_path):
    from quantkit.model.source_weights import SourceWeights
    from quantkit.quantization.disk_space import expected_bytes
    from quantkit.quantization.pipeline import _prepare

    def work_bytes(*algorithms) -> int:
        config = QuantizeConfig.for_method("gptq", *algorithms, scheme=SCHEME, calibration_file=tiny_calib_file)
        with SourceWeights(tiny_model_dir) as weights:
            return expected_bytes(_prepare(str(tiny_model_dir), config, tmp_path / "out", weights))["work directory"]

    tokens = load_file(str(tiny_calib_file))["input_ids"].numel()
    hidden = json.loads((tiny_model_dir / "config.json").read_text())["hidden_size"]
    stream = 2 * tokens * hidden * 4  # the current and the next input of a float32 tiny model
    assert work_bytes(HeadRefitConfig()) - work_bytes() == stream
