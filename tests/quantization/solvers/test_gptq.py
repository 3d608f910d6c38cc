"""GPTQ solver: agreement with RTN where it must, gains over RTN where it should, robustness."""

from __future__ import annotations

import pytest
import torch

from quantkit.format.scheme import QuantScheme
from quantkit.quantization.methods.gptq import GPTQConfig
from quantkit.quantization.solvers.gptq import gptq_solve, hessian_weighted_error
from quantkit.quantization.solvers.grid import quantize_rtn


def _correlated(n: int = 1024, k: int = 128, out: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Low-rank correlated inputs X = Z A + noise with uneven channel scales, and weights W."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=gen) @ torch.randn(16, k, generator=gen)
    x = (x + 0.1 * torch.randn(n, k, generator=gen)) * (0.2 + 2 * torch.rand(k, generator=gen))
    return x, torch.randn(out, k, generator=gen)


def _hessian(x: torch.Tensor) -> torch.Tensor:
    return 2.0 * x.T @ x / x.shape[0]


def _output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float(torch.linalg.norm(x @ w.T - x @ w_hat.T))


@pytest.mark.parametrize(
    "scheme",
    [
        QuantScheme(bits=4, group_size=128, symmetric=True),
        QuantScheme(bits=4, group_size=128, symmetric=False),
        QuantScheme(bits=3, group_size=-1, symmetric=False),
        QuantScheme(bits=4, group_size=128, symmetric=True, mse_clip=True),
    ],
    ids=lambda s: s.name,
)
@pytest.mark.slow
def test_identity_hessian_equals_rtn_exactly(scheme: QuantScheme) -> None:
    w = torch.randn(8, 576, generator=torch.Generator().manual_seed(0))  # 5 groups, last 64 wide
    h = 4.0 * torch.eye(576)  # power of two: the mse_clip weights scale errors exactly
    result = gptq_solve(w, h, scheme, GPTQConfig(block_size=96))  # blocks not aligned with groups
    rtn = quantize_rtn(w, scheme)
    assert not result.fell_back_to_rtn and result.weight.g_idx is None
    assert torch.equal(result.weight.qweight, rtn.qweight)
    assert torch.equal(result.weight.scale, rtn.scale)
    assert torch.equal(result.weight.dequantize(), rtn.dequantize())


@pytest.mark.parametrize("symmetric", [True, False])
def test_beats_rtn_on_correlated_inputs(symmetric: bool) -> None:
    x, w = _correlated()
    scheme = QuantScheme(bits=4, group_size=64, symmetric=symmetric)
    result = gptq_solve(w, _hessian(x), scheme, GPTQConfig())
    ratio = _output_error(x, w, result.weight.dequantize()) / _output_error(x, w, quantize_rtn(w, scheme).dequantize())
    assert ratio <= 0.5  # measured ~0.27


def test_loss_is_the_damped_hessian_weighted_error() -> None:
    x, w = _correlated()
    h = _hessian(x)
    result = gptq_solve(w, h, QuantScheme(bits=4, group_size=32, symmetric=False), GPTQConfig())
    damped = h + result.damp * h.diagonal().mean() * torch.eye(h.shape[0])
    expected = hessian_weighted_error(w, result.weight.dequantize(), damped)
    assert result.loss == pytest.approx(expected, rel=1e-4)


def test_block_size_does_not_change_the_result() -> None:
    """Group params see every earlier column's update, also inside a block: blocking is only a speed-up."""
    x, w = _correlated()
    scheme = QuantScheme(bits=4, group_size=32, symmetric=False, act_order=True)
    a = gptq_solve(w, _hessian(x), scheme, GPTQConfig(block_size=128))
    b = gptq_solve(w, _hessian(x), scheme, GPTQConfig(block_size=24))
    assert (a.weight.qweight != b.weight.qweight).float().mean() < 1e-3
    assert a.loss == pytest.approx(b.loss, rel=1e-3)


def test_act_order_records_a_valid_group_index() -> None:
    x, w = _correlated(k=200)
    scheme = QuantScheme(bits=4, group_size=64, act_order=True)
    result = gptq_solve(w, _hessian(x), scheme, GPTQConfig())
    g_idx = result.weight.g_idx
    assert g_idx is not None and g_idx.dtype == torch.int32 and g_idx.shape == (200,)
    assert int(g_idx.min()) >= 0 and int(g_idx.max()) < scheme.num_groups(200)
    assert torch.bincount(g_idx.long(), minlength=4).tolist() == [64, 64, 64, 8]
    assert not torch.equal(g_idx.long(), torch.arange(200) // 64)  # really permuted
    # The most important column (largest diag H) is processed first, so it is in group 0.
    assert int(g_idx[int(_hessian(x).diagonal().argmax())]) == 0
    rtn = quantize_rtn(w, QuantScheme(bits=4, group_size=64))
    ratio = _output_error(x, w, result.weight.dequantize()) / _output_error(x, w, rtn.dequantize())
    assert ratio <= 0.5  # measured ~0.07


def test_act_order_static_groups_keeps_column_groups() -> None:
    x, w = _correlated()
    scheme = QuantScheme(bits=4, group_size=32, act_order=True, static_groups=True)
    result = gptq_solve(w, _hessian(x), scheme, GPTQConfig())
    assert result.weight.g_idx is None and result.weight.scale.shape == (32, 4)
    rtn = quantize_rtn(w, QuantScheme(bits=4, group_size=32))
    assert torch.equal(result.weight.scale, rtn.scale)  # params come from the un-updated W
    ratio = _output_error(x, w, result.weight.dequantize()) / _output_error(x, w, rtn.dequantize())
    assert ratio <= 0.5  # measured ~0.07


@pytest.mark.parametrize("symmetric", [True, False])
def test_dead_columns_become_zero(symmetric: bool) -> None:
    x, w = _correlated(k=64)
    dead = [3, 17, 40]
    x[:, dead] = 0.0
    scheme = QuantScheme(bits=4, group_size=32, symmetric=symmetric, act_order=True)
    result = gptq_solve(w, _hessian(x), scheme, GPTQConfig())
    deq = result.weight.dequantize()
    assert not result.fell_back_to_rtn
    assert bool(torch.isfinite(deq).all()) and bool(torch.isfinite(result.weight.scale).all())
    assert torch.equal(deq[:, dead], torch.zeros(32, 3))
    assert bool(deq[:, 0].abs().sum() > 0)


@pytest.mark.parametrize("bad", ["nan", "negative_definite"])
def test_unfactorable_hessian_falls_back_to_rtn(bad: str) -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    h = -10.0 * torch.eye(64)
    if bad == "nan":
        h = _hessian(_correlated(k=64)[0])
        h[5, 7] = float("nan")  # upper triangle only: Cholesky alone would never read it
    scheme = QuantScheme(bits=4, group_size=32)
    with pytest.warns(RuntimeWarning, match="'model.layers.3.mlp.down_proj'"):
        result = gptq_solve(w, h, scheme, GPTQConfig(), name="model.layers.3.mlp.down_proj")
    assert result.fell_back_to_rtn
    if bad == "negative_definite":  # every retry was tried (a NaN is rejected before any attempt)
        assert result.damp == pytest.approx(0.01 * 10.0**3)
    assert torch.equal(result.weight.dequantize(), quantize_rtn(w, scheme).dequantize())


def test_small_damping_is_retried() -> None:
    """A singular H fails without damping; the retry with a grown damp succeeds."""
    x, w = _correlated(n=8, k=32)  # rank 8 < 32
    h = _hessian(x).double().float()
    result = gptq_solve(w, h, QuantScheme(bits=4, group_size=32), GPTQConfig(damp=0.0, damp_retries=2))
    assert not result.fell_back_to_rtn
    assert result.damp >= 1e-4


def test_each_attempt_factors_exactly_the_damped_hessian_and_h_is_not_modified() -> None:
    """A failed attempt spoils the working buffer: the retry rebuilds it, so it factors exactly H + damp I."""
    from quantkit.quantization.solvers.gptq import _factor_with_retries

    x, _ = _correlated(n=8, k=32)  # rank 8 < 32: damp 0 fails, the first retry (damp 1e-4) succeeds
    h = _hessian(x).double().float()
    before = h.clone()
    u, damp = _factor_with_retries(h, None, torch.zeros(32, dtype=torch.bool), GPTQConfig(damp=0.0, damp_retries=2))
    assert u is not None and damp == 1e-4
    assert torch.equal(h, before)
    fresh = before.clone()
    fresh.diagonal().add_(damp * float(before.diagonal().mean()))
    lower, _ = torch.linalg.cholesky_ex(fresh)  # the out-of-place chain, for reference
    upper, _ = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
    assert torch.equal(u, upper) and u.stride() == upper.stride()


def test_inputs_are_not_mutated() -> None:
    x, w = _correlated(k=64)
    x[:, 2] = 0.0  # a dead column: the solver zeroes it on its own copy only
    h = _hessian(x)
    w_before, h_before = w.clone(), h.clone()
    gptq_solve(w, h, QuantScheme(bits=4, group_size=32, act_order=True, mse_clip=True), GPTQConfig())
    assert torch.equal(w, w_before) and torch.equal(h, h_before)


def test_hessian_weighted_error() -> None:
    x, w = _correlated(k=64)
    h = _hessian(x)
    assert hessian_weighted_error(w, w, h) == 0.0
    w_hat = quantize_rtn(w, QuantScheme(bits=4, group_size=32)).dequantize()
    delta = (w - w_hat).double()
    direct = float(torch.trace(delta @ h.double() @ delta.T))
    for chunk in (256, 7):  # one float64 slice of H, or several (the last one short)
        assert hessian_weighted_error(w, w_hat, h, chunk=chunk) == pytest.approx(direct, rel=1e-10)
    # With H = 2 X^T X / n it is twice the mean squared output error per token.
    assert direct == pytest.approx(2.0 * _output_error(x, w, w_hat) ** 2 / x.shape[0], rel=1e-4)
