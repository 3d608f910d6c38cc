"""GPTQ and RTN on llama.cpp's grids: bytes that gguf decodes to exactly the solver's weights, GPTQ = RTN where it
must be, GPTQ < RTN where it should be, and parameters at least as good as llama.cpp's reference quantizers'."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.format.ggml.grids import GGML_GRIDS, effective
from quantkit.format.ggml.types import GGML_TYPES, row_bytes
from quantkit.quantization.methods.gptq import GPTQConfig
from quantkit.quantization.solvers.ggml_solve import GGMLSolveResult, ggml_gptq, ggml_rtn
from quantkit.quantization.solvers.gptq import hessian_weighted_error

NAMES = list(GGML_GRIDS)
CONFIG = GPTQConfig()


def _correlated(n: int = 768, k: int = 512, out: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs with correlated columns (low rank plus noise, uneven channel scales) and weights W."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 24, generator=gen) @ torch.randn(24, k, generator=gen)
    x = (x + 0.2 * torch.randn(n, k, generator=gen)) * (0.2 + 2 * torch.rand(k, generator=gen))
    return x, torch.randn(out, k, generator=gen) * 0.05


def _hessian(x: torch.Tensor) -> torch.Tensor:
    return 2.0 * x.T @ x / x.shape[0]


def _assert_decodes_exactly(name: str, result: GGMLSolveResult, shape: tuple[int, int]) -> None:
    t = GGML_TYPES[name]
    assert result.data.dtype == np.uint8 and result.data.shape == (shape[0], row_bytes(t, shape[1]))
    theirs = gguf.quants.dequantize(result.data, t.qtype)
    ours = result.dequantized.numpy()
    assert ours.dtype == np.float32 and ours.shape == shape
    assert np.array_equal(theirs.view(np.uint32), ours.view(np.uint32))


def _awkward_weights(k: int) -> torch.Tensor:
    """Rows of varied scale, a zero row, a row of one constant, large and tiny magnitudes, a lone outlier."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(8, k, generator=gen) * torch.logspace(-3, 0, 8).unsqueeze(1)
    w[1] = 0
    w[2] = 0.37
    w[3] = torch.randn(k, generator=gen) * 1e3
    w[4] = torch.randn(k, generator=gen) * 1e-5
    w[5, 7] = 40.0
    return w


@pytest.mark.parametrize("name", NAMES)
def test_bytes_decode_to_the_solver_weights(name: str) -> None:
    k = 512
    w = _awkward_weights(k)
    x, _ = _correlated(k=k)
    for result in (ggml_rtn(w, name), ggml_gptq(w, _hessian(x), name, CONFIG), ggml_rtn(w, name, importance=x.var(0))):
        _assert_decodes_exactly(name, result, (8, k))
        assert torch.isfinite(result.dequantized).all()
        assert float(result.dequantized[1].abs().max()) == 0.0  # a zero row stays exactly zero
    rtn = ggml_rtn(w, name)
    assert torch.allclose(rtn.dequantized[2], w[2], rtol=0.05)  # a constant row stays near its value


@pytest.mark.parametrize("name", NAMES)
def test_gptq_with_identity_hessian_is_rtn(name: str) -> None:
    _, w = _correlated(k=512)
    rtn = ggml_rtn(w, name)
    gptq = ggml_gptq(w, torch.eye(512), name, CONFIG)
    assert not gptq.fell_back_to_rtn
    assert np.array_equal(gptq.data, rtn.data)


@pytest.mark.parametrize("name", NAMES)
def test_gptq_beats_rtn_on_correlated_inputs(name: str) -> None:
    x, w = _correlated()
    h = _hessian(x)
    rtn = hessian_weighted_error(w, ggml_rtn(w, name, importance=h.diagonal()).dequantized, h)
    gptq = ggml_gptq(w, h, name, CONFIG)
    act = ggml_gptq(w, h, name, CONFIG, act_order=True)
    _assert_decodes_exactly(name, act, tuple(w.shape))
    assert hessian_weighted_error(w, gptq.dequantized, h) < 0.5 * rtn
    assert hessian_weighted_error(w, act.dequantized, h) < 0.5 * rtn


def test_reported_loss_is_the_damped_hessian_error() -> None:
    x, w = _correlated()
    h = _hessian(x)
    result = ggml_gptq(w, h, "Q4_K", CONFIG)
    damped = h + result.damp * float(h.diagonal().mean()) * torch.eye(h.shape[0])
    assert result.loss == pytest.approx(hessian_weighted_error(w, result.dequantized, damped), rel=1e-3)


def _reference_gptq(w: torch.Tensor, h: torch.Tensor, name: str, result: GGMLSolveResult) -> torch.Tensor:
    """The textbook loop (one column at a time, every later column updated at once) on the fast loop's parameters."""
    grid = GGML_GRIDS[name]
    assert result.params is not None
    s, o = effective(grid, result.params)
    s = s.repeat_interleave(grid.sub, 1)
    o = torch.zeros_like(s) if o is None else o.repeat_interleave(grid.sub, 1)
    k = w.shape[1]
    hd = h.double() + result.damp * float(h.diagonal().mean()) * torch.eye(k, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hd)), upper=True)
    work = w.double().clone()
    out = torch.empty_like(work)
    values = grid.level_values.double()
    for j in range(k):
        t = (work[:, j] + o[:, j]) / torch.where(s[:, j] == 0, torch.inf, s[:, j].double())
        level = values[(t.unsqueeze(1) - values).abs().argmin(1)]  # nearest level (clamps at the ends)
        out[:, j] = s[:, j] * level - o[:, j]
        err = (work[:, j] - out[:, j]) / u[j, j]
        work[:, j:] -= err.unsqueeze(1) * u[j, j:].unsqueeze(0)
    return out.float()


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "IQ4_NL"])
def test_fast_loop_matches_the_textbook_loop(name: str) -> None:
    x, w = _correlated(k=256, out=8)
    h = _hessian(x)
    result = ggml_gptq(w, h, name, CONFIG)
    ref = _reference_gptq(w, h, name, result)
    same = (ref == result.dequantized).float().mean()
    assert float(same) > 0.995  # float32 lazy batches vs float64: a rare tie may round the other way


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_rtn_is_no_worse_than_gguf_reference_quantizer(name: str) -> None:
    """Per block the reference choice is one of the candidates, evaluated as stored: never a larger error."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, 512, generator=gen) * (0.01 + torch.rand(64, 1, generator=gen))
    t = GGML_TYPES[name]
    theirs = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), t.qtype), t.qtype)
    err_theirs = ((w.numpy() - theirs) ** 2).reshape(64, -1, 32).sum(-1)
    err_ours = ((w - ggml_rtn(w, name).dequantized) ** 2).reshape(64, -1, 32).sum(-1).numpy()
    assert (err_ours <= err_theirs * (1 + 1e-6)).all()
    assert err_ours.sum() < err_theirs.sum()


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "IQ4_NL"])
def test_importance_moves_the_parameters_toward_important_columns(name: str) -> None:
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(32, 512, generator=gen)
    importance = torch.where(torch.rand(512, generator=gen) < 0.1, 50.0, 0.5)

    def weighted(result: GGMLSolveResult) -> float:
        return float((((w - result.dequantized) ** 2) * importance).sum())

    plain, weighted_fit = ggml_rtn(w, name), ggml_rtn(w, name, importance=importance)
    assert weighted(weighted_fit) < 0.97 * weighted(plain)
    assert weighted_fit.loss == pytest.approx(weighted(weighted_fit) / float(importance.mean()), rel=1e-3)


@pytest.mark.parametrize("name", NAMES)
def test_act_order_codes_lie_on_the_fixed_grid(name: str) -> None:
    """Act-order moves columns, not sub-blocks: each code decodes with its own column's sub-block parameters."""
    x, w = _correlated(k=256, out=8, seed=2)
    result = ggml_gptq(w, _hessian(x), name, CONFIG, act_order=True)
    grid = GGML_GRIDS[name]
    assert result.params is not None
    s, o = effective(grid, result.params)
    values = result.dequantized.reshape(8, -1, grid.sub)
    o = torch.zeros_like(s) if o is None else o
    levels = (values + o.unsqueeze(-1)) / torch.where(s == 0, 1.0, s).unsqueeze(-1)
    allowed = grid.level_values
    assert torch.isin(levels[s != 0].round(), allowed).all()
    assert torch.allclose(levels[s != 0], levels[s != 0].round(), atol=1e-3)


def test_bad_inputs_are_user_errors() -> None:
    w = torch.randn(4, 512)
    with pytest.raises(QuantkitError, match="multiple of 256"):
        ggml_rtn(torch.randn(4, 576), "Q4_K")
    with pytest.raises(QuantkitError, match="multiple of 32"):
        ggml_gptq(torch.randn(4, 100), torch.eye(100), "Q8_0", CONFIG)
    bad = w.clone()
    bad[0, 3] = float("nan")
    with pytest.raises(QuantkitError, match="NaN or infinite"):
        ggml_rtn(bad, "Q4_0")
    bad[0, 3] = float("inf")
    with pytest.raises(QuantkitError, match="NaN or infinite"):
        ggml_gptq(bad, torch.eye(512), "Q6_K", CONFIG)
    with pytest.raises(QuantkitError, match="2-D"):
        ggml_rtn(torch.randn(512), "Q4_0")
    with pytest.raises(QuantkitError, match="Hessian shape"):
        ggml_gptq(w, torch.eye(256), "Q4_K", CONFIG)
    with pytest.raises(QuantkitError, match="importance"):
        ggml_rtn(w, "Q4_K", importance=torch.ones(256))
    with pytest.raises(QuantkitError, match="unknown GGML type"):
        ggml_rtn(w, "Q7_K")


def test_unfactorable_hessian_falls_back_to_rtn_with_a_warning() -> None:
    w = torch.randn(4, 256)
    h = torch.full((256, 256), float("nan"))
    with pytest.warns(RuntimeWarning, match="layer 'mlp.down'"):
        result = ggml_gptq(w, h, "Q4_K", CONFIG, name="mlp.down")
    assert result.fell_back_to_rtn and np.isnan(result.loss)
    _assert_decodes_exactly("Q4_K", result, (4, 256))
