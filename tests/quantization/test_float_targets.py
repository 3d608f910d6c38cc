"""GPTQ toward float targets (GPTAQ plus the residual stream's error): the target weight is the damped
least-squares fit of the float outputs (less the stream's error) on the quantized inputs, it is the weight
itself where the two streams agree, the float path computes the float block's output on the way, and in a real
run the quantized model's logit error against the float model falls."""

import copy
import itertools
import json

import pytest
import torch
from helpers.cli import run_cli
from helpers.tiny import logit_error, tiny_llama

from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantScheme
from quantkit.model.architectures import arch_for_model_type
from quantkit.model.blocks import BlockRunner
from quantkit.model.staged_block import StagedBlock
from quantkit.quantization.block_loop import stage_hessians
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods.float_targets import (
    FloatCompanion,
    FloatPath,
    FloatTargetsConfig,
    StageMoments,
    float_target,
)
from quantkit.quantization.methods.rotation import RotationConfig
from quantkit.quantization.pipeline import quantize_model


def _moments(
    x: torch.Tensor, x_quantized: torch.Tensor, error: torch.Tensor | None = None
) -> tuple[torch.Tensor, StageMoments]:
    """GPTQ's ``H = 2 X~^T X~ / n`` and the matching moments, accumulated in two halves."""
    k, n = x.shape[1], x.shape[0]
    hessian = 2.0 / n * x_quantized.T @ x_quantized
    moments = StageMoments(k, torch.device("cpu"), dtype=x.dtype)
    for half in (slice(0, n // 2), slice(n // 2, n)):
        moments.add(x[half], x_quantized[half], None if error is None else error[half])
    moments.normalise_()
    return hessian, moments


def test_agreeing_streams_leave_the_weight_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(300, 16, generator=gen), torch.randn(8, 16, generator=gen)
    hessian, moments = _moments(x, x)
    shift = moments.shift("w", weight)
    assert torch.allclose(float_target(weight, hessian, shift, damp=0.01), weight, atol=1e-5)


def test_the_direct_shift_equals_the_one_from_the_gap_moment() -> None:
    """Given the weight up front, the shift is summed directly (cheaper where the outputs are fewer than half the
    inputs, as down_proj's); it is the same ``W (C - H) - E``."""
    x, x_quantized, weight = _drifted(5)
    error = 0.1 * torch.randn(400, 6, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    _, via_gap = _moments(x, x_quantized, error)
    direct = StageMoments(12, torch.device("cpu"), {"w": weight}, dtype=torch.float64)
    for half in (slice(0, 200), slice(200, 400)):
        direct.add(x[half], x_quantized[half], error[half])
    direct.normalise_()
    assert direct.gap is None and direct.residual is None  # nothing [K, K] is kept
    expected = via_gap.shift("w", weight)
    assert torch.allclose(direct.shift("w", weight), expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
    assert StageMoments.direct_is_cheaper(1536, [576]) and not StageMoments.direct_is_cheaper(576, [576, 192, 192])


@pytest.mark.parametrize("direct", [False, True])
def test_moments_taken_by_chunks_and_put_back_as_totals(direct: bool) -> None:
    """The block loop takes the sums chunk by chunk (to add them up in the Hessians' order on any number of
    processes): one chunk put back as the totals is the running sum, bit for bit; the next chunk starts at zero."""
    x, x_quantized, weight = _drifted(7)
    error = 0.1 * torch.randn(400, 6, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    weights = {"w": weight} if direct else None
    running = StageMoments(12, torch.device("cpu"), weights, dtype=torch.float64)
    chunked = StageMoments(12, torch.device("cpu"), weights, dtype=torch.float64)
    for part in (slice(0, 150), slice(150, 400)):
        running.add(x[part], x_quantized[part], error[part])
        chunked.add(x[part], x_quantized[part], error[part])
    taken = chunked.take_chunk()
    assert sorted(taken) == (["shift:w"] if direct else ["gap", "residual"])
    assert all(float(v.abs().sum()) == 0.0 for v in chunked.take_chunk().values())  # fresh buffers
    chunked.put_totals(taken, 400)
    running.normalise_()
    chunked.normalise_()
    assert torch.equal(chunked.shift("w", weight), running.shift("w", weight))


def _drifted(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(400, 12, generator=gen, dtype=torch.float64)
    drift = torch.eye(12, dtype=torch.float64) + 0.3 * torch.randn(12, 12, generator=gen, dtype=torch.float64)
    x_quantized = x @ drift + 0.01 * torch.randn(400, 12, generator=gen, dtype=torch.float64)  # the drifted stream
    weight = torch.randn(6, 12, generator=gen, dtype=torch.float64)
    return x, x_quantized, weight


def _orthogonal_to_inputs(residual: torch.Tensor, x_quantized: torch.Tensor, scale: torch.Tensor) -> bool:
    """The normal equations of least squares: the residual is orthogonal to every input column."""
    return float((residual.T @ x_quantized).abs().max()) < 1e-3 * float(scale.abs().max() * len(x_quantized))


def test_the_target_fits_the_float_outputs_on_the_quantized_inputs() -> None:
    """Undamped, the target is the least-squares solution: its residual is orthogonal to the quantized inputs,
    and it fits the float outputs better than the weight itself does."""
    x, x_quantized, weight = _drifted(1)
    hessian, moments = _moments(x, x_quantized)
    assert moments.residual is None  # no stream error given: a stage that does not write the residual stream
    target = float_target(weight, hessian, moments.shift("w", weight), damp=0.0)  # minimum damping only
    residual = x @ weight.T - x_quantized @ target.T
    assert _orthogonal_to_inputs(residual, x_quantized, x @ weight.T)
    plain = x @ weight.T - x_quantized @ weight.T
    assert float(residual.square().sum()) < 0.5 * float(plain.square().sum())  # measured: 1e-4x


def test_a_residual_writer_also_cancels_the_streams_error() -> None:
    """With the stream's error ``e`` where the output is added, the target fits ``W x - e``: the block output
    ``h~ + Q x~`` then follows the float ``h + W x``."""
    x, x_quantized, weight = _drifted(2)
    gen = torch.Generator().manual_seed(3)
    # an error the quantized inputs partly explain (as earlier layers' errors do), plus noise they do not
    error = x_quantized @ (0.2 * torch.randn(12, 6, generator=gen, dtype=torch.float64))
    error += 0.05 * torch.randn(400, 6, generator=gen, dtype=torch.float64)
    hessian, moments = _moments(x, x_quantized, error)
    assert moments.residual is not None and moments.residual.shape == (6, 12)
    target = float_target(weight, hessian, moments.shift("w", weight), damp=0.0)
    wanted = x @ weight.T - error
    residual = wanted - x_quantized @ target.T
    assert _orthogonal_to_inputs(residual, x_quantized, wanted)
    _, plain_moments = _moments(x, x_quantized)
    without = float_target(weight, hessian, plain_moments.shift("w", weight), damp=0.0)
    block_error_without = (wanted - x_quantized @ without.T).square().sum()
    assert float(residual.square().sum()) < 0.5 * float(block_error_without)


def test_the_ridge_pulls_the_target_towards_the_float_weight() -> None:
    """The targets' ridge is damping added to GPTQ's: the more of it, the closer the target to the float weight
    (plain GPTQ's target), which it reaches in the limit."""
    x, x_quantized, weight = _drifted(4)
    hessian, moments = _moments(x, x_quantized)
    shift = moments.shift("w", weight)
    distances = [
        float((float_target(weight, hessian, shift, damp=0.01 + ridge) - weight).norm() / weight.norm())
        for ridge in (0.0, 0.05, 1.0, 100.0)
    ]
    assert all(a > b for a, b in itertools.pairwise(distances))  # measured: 1.38, 0.81, 0.30, 0.0097
    assert distances[-1] < 0.02 < 0.5 < distances[0]
    with pytest.raises(QuantkitError, match="ridge must be >= 0"):
        FloatTargetsConfig(ridge=-0.1)


def _stage_inputs_and_output(block, arch, runner, hidden) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each stage's inputs [tokens, K] and the output of a copy of ``block`` run stage by stage on ``hidden``."""
    staged = StagedBlock(copy.deepcopy(block), arch, runner, hidden.clone())
    inputs = {}
    for stage in arch.stages:
        x = torch.cat([batch.clone() for batch in staged.stage_inputs(stage.name)])  # down's reuse one buffer
        inputs[stage.name] = x.reshape(-1, x.shape[-1])
    return inputs, staged.output()


def test_the_float_path_gives_the_float_blocks_inputs_and_output() -> None:
    """Run beside a quantized block, the float path pairs the float block's stage inputs with the quantized
    block's, gives the float block's output, and leaves inference mode off again (two generators enter and leave
    it out of order)."""
    model = tiny_llama(seed=5)
    arch = arch_for_model_type("llama")
    runner = BlockRunner.for_model(model, arch, 16, batch_size=3)
    block = model.model.layers[0]
    gen = torch.Generator().manual_seed(4)
    reference = torch.randn(7, 16, 64, generator=gen).to(torch.bfloat16)
    quantized_input = (reference.float() + 0.05 * torch.randn(7, 16, 64, generator=gen)).to(torch.bfloat16)
    float_inputs, float_output = _stage_inputs_and_output(block, arch, runner, reference)
    quantized_inputs, _ = _stage_inputs_and_output(block, arch, runner, quantized_input)
    path = FloatPath(block, arch, runner, reference)
    staged = StagedBlock(copy.deepcopy(block), arch, runner, quantized_input.clone())
    stages = []
    for stage, _, (moments,) in stage_hessians(staged, companions=[FloatCompanion(path)]):
        assert moments is not None and moments.count == 7 * 16
        x, x_quantized = float_inputs[stage.name], quantized_inputs[stage.name]
        if moments.gap is not None:
            assert (moments.residual is not None) == (stage.name == "o")  # a residual stream writer
            gap = 2.0 / len(x) * (x - x_quantized).T @ x_quantized
            assert torch.allclose(moments.gap, gap, rtol=1e-4, atol=1e-6)
        else:  # down_proj's shift, summed directly (intermediate 160 > 2 x hidden 64)
            assert stage.name == "down" and set(moments.shifts) == {"mlp.down_proj"}
        stages.append(stage.name)
    assert stages == [stage.name for stage in arch.stages]
    assert not torch.is_inference_mode_enabled()
    # the same arithmetic as the block's own MLP, up to the order of float32 operations
    assert torch.allclose(path.output().float(), float_output.float(), rtol=1e-2, atol=1e-2)


SCHEME = QuantScheme(bits=3, group_size=32)


@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
def test_float_targets_lower_the_logit_error(tiny_model_dir, tiny_calib_file, tmp_path, rotate) -> None:
    errors = {}
    for float_targets in (False, True):
        out = tmp_path / f"float-targets-{float_targets}"
        extra = [FloatTargetsConfig()] if float_targets else []
        config = QuantizeConfig.for_method(
            "gptq",
            *extra,
            RotationConfig("hadamard" if rotate else "none"),
            scheme=SCHEME,
            calibration_file=tiny_calib_file,
            show_progress=False,
            batch_size=2,
        )
        quantize_model(str(tiny_model_dir), config, out)
        errors[float_targets] = logit_error(tiny_model_dir, out, tiny_calib_file)
        logged = json.loads((out / "quantkit_log.json").read_text())["solvers"]
        assert ("float_targets" in logged) is float_targets and ("rotation" in logged) is rotate
    assert errors[True] < 0.5 * errors[False]


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_the_cli_refuses_float_targets_without_gptq(tiny_model_dir, tiny_calib_file, tmp_path, capsys, method):
    out = tmp_path / "out"
    args = ["quantize", str(tiny_model_dir), "-o", str(out), "--calib", str(tiny_calib_file), "--method", method]
    code, _, err = run_cli([*args, "--group-size", "32", "--float-targets"], capsys)
    assert code == 2 and not out.exists()
    use = "use gptq, awq+gptq, smoothquant+gptq"
    assert f"float targets work only with gptq: method '{method}' has no gptq step; {use}" in err


@pytest.mark.parametrize("direct", [False, True], ids=["gap", "direct"])
def test_bfloat16_products_keep_the_shift_to_its_own_scale(direct: bool) -> None:
    """Every moment has a difference as a factor, so bfloat16 products (``--compute-dtype bfloat16``) round
    relative to the shift itself: it stays within 1% of the float32 one, although the drift between the streams
    is small next to the activations."""
    x, x_quantized, weight = (t.float() for t in _drifted(9))
    x_quantized = x + 0.05 * (x_quantized - x)  # streams that nearly agree: C and H would nearly cancel
    error = 0.01 * torch.randn(400, 6, generator=torch.Generator().manual_seed(10))
    shifts = []
    for product_dtype in (torch.float32, torch.bfloat16):
        moments = StageMoments(12, torch.device("cpu"), {"w": weight} if direct else None, product_dtype=product_dtype)
        for half in (slice(0, 200), slice(200, 400)):
            moments.add(x[half], x_quantized[half], error[half])
        moments.normalise_()
        shifts.append(moments.shift("w", weight))
    exact, low = shifts
    relative = float((low - exact).norm() / exact.norm())
    assert 1e-6 < relative < 1e-2, relative


def test_a_bfloat16_run_stays_close_to_the_float32_run(tiny_model_dir, tiny_calib_file, tmp_path) -> None:
    """The quality setting with --compute-dtype bfloat16: the logit error is within 50% of the float32 run's, and
    the solve's fingerprint differs (a resumed run cannot mix the two). On this tiny model (128 tokens) the
    bfloat16 run's error moves by a quarter with the order the CPU's bfloat16 kernels sum in (AMX or AVX-512, and
    the buffers' alignment: measured 1.24x after the GGUF tests on an AMX CPU, within 1.2x alone), so the bound
    leaves room for that."""
    errors, fingerprints = {}, {}
    for name in ("float32", "bfloat16"):
        out = tmp_path / name
        config = QuantizeConfig.for_method(
            "gptq",
            FloatTargetsConfig(),
            RotationConfig("hadamard"),
            scheme=SCHEME,
            calibration_file=tiny_calib_file,
            show_progress=False,
            batch_size=2,
            compute_dtype=name,
        )
        quantize_model(str(tiny_model_dir), config, out)
        errors[name] = logit_error(tiny_model_dir, out, tiny_calib_file)
        fingerprints[name] = json.loads((out / "quantkit_log.json").read_text())["fingerprints"]["scheme"]
    assert errors["bfloat16"] < 1.5 * errors["float32"], errors
    assert fingerprints["bfloat16"] != fingerprints["float32"]
