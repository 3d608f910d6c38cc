"""Block-output tuning (AutoRound-style): lowers the block's output error, never raises it, keeps the integer
format's invariants, and is deterministic."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.tiny import rtn_for_tests, tiny_llama
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.model.architectures import arch_for_model_type
from quantkit.model.blocks import BlockRunner, get_module
from quantkit.quantization.methods.tune import OFFSET_LR, SCALE_LR, TuneConfig
from quantkit.quantization.solvers import tune
from quantkit.quantization.solvers.tune import (
    SCALE_RANGE,
    TuneResult,
    tune_block,
    window_losses,
)

LINEARS = arch_for_model_type("llama").linears  # down_proj's in-features 160: with groups of 64 the last is shorter
SEQ = 32


@pytest.fixture(scope="module")
def setup() -> tuple[nn.Module, BlockRunner, torch.Tensor, torch.Tensor]:
    """Layer 0 of a tiny Llama, 12 bf16 calibration windows and the float block's outputs on them."""
    model = tiny_llama(seed=3)
    runner = BlockRunner.for_model(model, arch_for_model_type("llama"), SEQ, batch_size=4)
    block = model.model.layers[0]
    gen = torch.Generator().manual_seed(7)
    inputs = torch.randn(12, SEQ, 64, generator=gen).to(torch.bfloat16)
    targets = runner.run(block, inputs, torch.float32)
    return block, runner, inputs, targets


def _start(block: nn.Module, scheme: QuantScheme, storage: torch.dtype = torch.bfloat16) -> dict[str, QuantizedWeight]:
    return {name: rtn_for_tests(get_module(block, name).weight, scheme, storage) for name in LINEARS}


def _run_with(block: nn.Module, runner: BlockRunner, inputs: torch.Tensor, weights: dict[str, QuantizedWeight]):
    """The block's outputs (inputs' dtype) computed the ordinary way, on a copy holding the dequantized weights."""
    holder = copy.deepcopy(block)
    for name, weight in weights.items():
        get_module(holder, name).weight.data = weight.dequantize(torch.float32)
    return runner.run(holder, inputs)


def _mse(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    return float((outputs.double() - targets.double()).square().mean())


W3 = QuantScheme(bits=3, group_size=32, symmetric=True)
SCHEMES = [
    QuantScheme(bits=3, group_size=64, symmetric=True),
    QuantScheme(bits=4, group_size=32, symmetric=False),
    QuantScheme(bits=4, group_size=32, symmetric=True, act_order=True),  # with g_idx
]
STORAGES = [torch.bfloat16, torch.float16, torch.bfloat16]  # scale storage dtype for each
SCHEME_IDS = ["w3-g64-sym", "w4-g32-asym", "w4-g32-actorder"]
CONFIG = TuneConfig(steps=60, batch_windows=4)


def test_tuning_lowers_block_output_error(setup) -> None:
    block, runner, inputs, targets = setup
    start = _start(block, W3)
    tuned, result = tune_block(block, runner, inputs, targets, start, CONFIG, torch.bfloat16)
    assert result.kept and result.steps == CONFIG.steps == len(result.history)
    assert result.loss_after == result.loss_tuned
    before = _mse(_run_with(block, runner, inputs, start), targets)
    after = _mse(_run_with(block, runner, inputs, tuned), targets)
    # the recorded losses are those of the weights as written (dequantized from codes and stored scales)
    assert result.loss_before == pytest.approx(before, rel=1e-6)
    assert result.loss_after == pytest.approx(after, rel=1e-6)
    assert after < 0.8 * before  # measured: about 0.67x


@pytest.mark.parametrize("optimizer", ["sign", "adam"])
def test_diverging_learning_rate_keeps_the_start(setup, optimizer: str) -> None:
    block, runner, inputs, targets = setup
    start = _start(block, W3)
    config = TuneConfig(steps=8, batch_windows=2, lr=50.0, optimizer=optimizer)
    weights, result = tune_block(block, runner, inputs, targets, start, config, torch.bfloat16)
    assert not result.kept
    assert result.loss_after == result.loss_before
    assert all(weights[name] is start[name] for name in LINEARS)


def test_a_non_finite_loss_returns_the_start(setup) -> None:
    block, runner, inputs, targets = setup
    start = _start(block, W3)

    class NanWhileTraining:  # the optimiser's forward passes (with gradients) go wrong; scoring passes do not
        batch_size = runner.batch_size

        def functional(self, block, params, hidden):
            out = runner.functional(block, params, hidden)
            return out * float("nan") if torch.is_grad_enabled() else out

    weights, result = tune_block(block, NanWhileTraining(), inputs, targets, start, CONFIG, torch.bfloat16)
    assert result.steps == 0 and not result.kept and result.loss_after == result.loss_before
    assert all(weights[name] is start[name] for name in LINEARS)


def test_worse_tuned_weights_are_rejected(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """The final full-data check alone (the optimiser made to return every code one step up)."""
    block, runner, inputs, targets = setup
    start = _start(block, W3)

    def bad_optimise(block, runner, inputs, targets, linears, start_losses, config):
        state = {name: [torch.ones_like(p) for p in lin.parameters()] for name, lin in linears.items()}
        return state, [0.5]

    monkeypatch.setattr(tune, "_optimise", bad_optimise)
    weights, result = tune_block(block, runner, inputs, targets, start, CONFIG, torch.bfloat16)
    assert result.loss_tuned > result.loss_before
    assert not result.kept and result.loss_after == result.loss_before
    assert all(weights[name] is start[name] for name in LINEARS)


@pytest.mark.parametrize(("scheme", "storage"), list(zip(SCHEMES, STORAGES, strict=True)), ids=SCHEME_IDS)
def test_tuned_weights_keep_the_format(setup, scheme: QuantScheme, storage: torch.dtype) -> None:
    block, runner, inputs, targets = setup
    start = _start(block, scheme, storage)
    tuned, result = tune_block(block, runner, inputs, targets, start, CONFIG, storage)
    assert result.kept
    moved = 0
    for name in LINEARS:
        old, new = start[name], tuned[name]
        assert new.scheme == scheme
        assert new.qweight.dtype == torch.int8 and new.qweight.shape == old.qweight.shape
        assert int(new.qweight.min()) >= scheme.qmin and int(new.qweight.max()) <= scheme.qmax
        assert int((new.qweight.int() - old.qweight.int()).abs().max()) <= 1  # at most one grid step
        assert new.scale.dtype == torch.float32 and new.scale.shape == old.scale.shape
        assert torch.equal(new.scale, new.scale.to(storage).float())  # exactly representable in storage
        ratio = new.scale / old.scale
        assert float(ratio.min()) >= SCALE_RANGE[0] * 0.99 and float(ratio.max()) <= SCALE_RANGE[1] * 1.01
        moved += int((new.scale != old.scale).sum())
        assert (new.zero is None) == (old.zero is None)
        if old.zero is not None:
            assert torch.equal(new.zero, old.zero)
        assert (new.g_idx is None) == (old.g_idx is None)
        if old.g_idx is not None:
            assert torch.equal(new.g_idx, old.g_idx)
    assert moved > 0
    assert result.loss_after == pytest.approx(_mse(_run_with(block, runner, inputs, tuned), targets), rel=1e-6)


@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
def test_integer_export_matches_the_tuned_forward(setup, scheme: QuantScheme) -> None:
    """For any parameters in range, the returned integer weight dequantizes to the weight the optimiser used
    (exactly with float32 scales; with fp16 scales the same codes and the fp16-rounded scales)."""
    block = setup[0]
    gen = torch.Generator().manual_seed(1)
    for name, start in _start(block, scheme, torch.float16).items():
        lin = tune._TunedLinear(start, True, torch.device("cpu"))
        assert torch.equal(lin.fake_weight().detach(), start.dequantize())  # the starting point is the start
        with torch.no_grad():
            lin.offset.copy_(torch.rand(lin.offset.shape, generator=gen) * 2 - 1)
            lin.mult.copy_(torch.rand(lin.mult.shape, generator=gen) * 0.5 + 0.75)
        exact = lin.quantized(lin.snapshot(), torch.float32)
        assert torch.equal(exact.dequantize(), lin.fake_weight().detach()), name
        stored = lin.quantized(lin.snapshot(), torch.float16)
        assert torch.equal(stored.qweight, exact.qweight)
        assert torch.equal(stored.scale, (start.scale * lin.mult.detach()).to(torch.float16).float())
        delta = (stored.qweight.int() - start.qweight.int()).abs()
        assert int(delta.max()) == 1 and 0.2 < float((delta > 0).float().mean()) < 0.8  # |V| > 0.5 moves a code
        assert int(stored.qweight.min()) >= scheme.qmin and int(stored.qweight.max()) <= scheme.qmax


def test_fixed_scales(setup) -> None:
    block, runner, inputs, targets = setup
    start = _start(block, W3)
    config = TuneConfig(steps=60, batch_windows=4, tune_scales=False)
    tuned, result = tune_block(block, runner, inputs, targets, start, config, torch.bfloat16)
    assert result.kept and result.loss_after < 0.95 * result.loss_before
    assert all(torch.equal(tuned[name].scale, start[name].scale) for name in LINEARS)
    assert any(not torch.equal(tuned[name].qweight, start[name].qweight) for name in LINEARS)


def _same(a: tuple[dict[str, QuantizedWeight], TuneResult], b: tuple[dict[str, QuantizedWeight], TuneResult]) -> bool:
    (wa, ra), (wb, rb) = a, b
    same_weights = all(
        torch.equal(wa[n].qweight, wb[n].qweight) and torch.equal(wa[n].scale, wb[n].scale) for n in LINEARS
    )
    return same_weights and ra.history == rb.history and ra.loss_after == rb.loss_after


@pytest.mark.parametrize("optimizer", ["sign", "adam"])
def test_deterministic(setup, optimizer: str) -> None:
    block, runner, inputs, targets = setup
    start = _start(block, W3)
    config = TuneConfig(steps=20, batch_windows=3, optimizer=optimizer, seed=5)
    first = tune_block(block, runner, inputs, targets, start, config, torch.bfloat16)
    global_rng = torch.random.get_rng_state()
    second = tune_block(block, runner, inputs, targets, start, config, torch.bfloat16)
    assert torch.equal(torch.random.get_rng_state(), global_rng)  # the global generator is left alone
    assert _same(first, second)
    other = TuneConfig(steps=20, batch_windows=3, optimizer=optimizer, seed=6)
    other_seed = tune_block(block, runner, inputs, targets, start, other, torch.bfloat16)
    assert first[1].history != other_seed[1].history  # the seed draws the windows


def test_block_is_left_alone(setup) -> None:
    block, runner, inputs, targets = setup
    before = {k: v.clone() for k, v in block.state_dict().items()}
    tune_block(block, runner, inputs, targets, _start(block, W3), TuneConfig(steps=5), torch.bfloat16)
    after = block.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in block.parameters())


def test_caller_outputs_save_forward_passes(setup) -> None:
    """``start_outputs`` gives the same result as evaluating the start; ``keep_outputs`` returns exactly what
    ``runner.run`` computes with the returned weights (the next block's input)."""
    block, runner, inputs, targets = setup
    start = _start(block, W3)
    config = TuneConfig(steps=20, batch_windows=2)
    plain = tune_block(block, runner, inputs, targets, start, config, torch.bfloat16)
    start_out = _run_with(block, runner, inputs, start)
    given = tune_block(block, runner, inputs, targets, start, config, torch.bfloat16, start_outputs=start_out)
    assert _same(plain, given) and plain[1].loss_before == given[1].loss_before
    weights, result = tune_block(block, runner, inputs, targets, start, config, torch.bfloat16, keep_outputs=True)
    assert result.outputs is not None and result.outputs.dtype == inputs.dtype
    assert torch.equal(result.outputs, _run_with(block, runner, inputs, weights))
    assert plain[1].outputs is None


def test_runs_inside_inference_mode(setup) -> None:
    """Inputs, targets, weights and rotary tables all made under inference_mode, and the call made there too."""
    block, runner, inputs, targets = setup
    with torch.inference_mode():
        inf_inputs, inf_targets = inputs.clone(), targets.clone()
        inf_runner = BlockRunner(tuple(t.clone() for t in runner.position_embeddings), runner.batch_size)
        start = _start(block, W3)
        _, result = tune_block(block, inf_runner, inf_inputs, inf_targets, start, TuneConfig(steps=10), torch.bfloat16)
    assert result.steps == 10 and result.loss_after <= result.loss_before


def test_functional_call_matches_the_block(setup) -> None:
    block, runner, inputs, _ = setup
    params = {name: p.detach() for name, p in block.named_parameters()}
    with torch.no_grad():
        assert torch.equal(runner.functional(block, params, inputs[:2]), runner(block, inputs[:2]))
    losses = window_losses(block, runner, inputs, runner.run(block, inputs), _start(block, W3))
    assert losses.shape == (inputs.shape[0],) and bool((losses > 0).all())


def test_zero_steps_returns_the_start(setup) -> None:
    block, runner, inputs, targets = setup
    start = _start(block, W3)
    weights, result = tune_block(block, runner, inputs, targets, start, TuneConfig(steps=0), torch.bfloat16)
    assert all(weights[name] is start[name] for name in LINEARS)
    assert result.steps == 0 and not result.kept and result.loss_before is None
    assert set(result.to_dict()) == {
        "loss_before",
        "loss_after",
        "loss_tuned",
        "steps",
        "seconds",
        "kept",
        "codes_changed",
    }


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"steps": -1}, "--tune-steps"),
        ({"batch_windows": 0}, "--tune-batch-windows"),
        ({"lr": 0.0}, "--tune-lr"),
        ({"scale_lr": -1.0}, "--tune-scale-lr"),
        ({"optimizer": "sgd"}, "optimizer"),
    ],
)
def test_invalid_config(kwargs: dict[str, object], flag: str) -> None:
    with pytest.raises(QuantkitError, match=flag):
        TuneConfig(**kwargs)  # type: ignore[arg-type]


def test_default_learning_rates_do_not_shrink_with_the_step_count() -> None:
    assert TuneConfig(steps=40).lr == TuneConfig(steps=400).lr == OFFSET_LR
    assert TuneConfig(steps=40).scale_lr == TuneConfig(steps=400).scale_lr == SCALE_LR
