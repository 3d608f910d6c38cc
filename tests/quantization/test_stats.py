"""Mergeable calibration statistics: merge == concatenate, flattening, persistence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantkit.errors import CalibrationError, QuantkitError
from quantkit.quantization.statistics import ActStat, HessianStat


def _inputs(rows: int = 40, k: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hessian_merge_of_halves_equals_concatenation(dtype: torch.dtype) -> None:
    x = _inputs()
    whole, first, second = HessianStat.zeros(24, dtype), HessianStat.zeros(24, dtype), HessianStat.zeros(24, dtype)
    whole.update(x)
    first.update(x[:15])
    second.update(x[15:])
    merged = first.merge(second)
    assert merged.count == whole.count == 40
    assert merged.xtx.dtype == dtype
    assert torch.allclose(merged.xtx, whole.xtx, rtol=1e-6, atol=1e-5)
    expected = 2.0 / 40 * x.double().T @ x.double()
    assert whole.hessian().dtype == torch.float32
    assert torch.allclose(whole.hessian().double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [255, 256, 577, 1000])
def test_upper_triangle_gram_equals_full_product_and_is_symmetric(k: int) -> None:
    x = _inputs(rows=300, k=k, seed=k)
    h = HessianStat.zeros(k, torch.float64)
    h.update(x[:100])
    h.update(x[100:])  # accumulates into a non-zero matrix
    expected = x.double().T @ x.double()
    assert torch.allclose(h.xtx, expected, rtol=1e-12, atol=1e-9)
    assert torch.equal(h.xtx, h.xtx.T)  # mirrored from one triangle: exactly symmetric
    assert torch.equal(h.hessian(), h.hessian().T)


@pytest.mark.parametrize(("k", "dtype"), [(100, torch.float32), (577, torch.float32), (600, torch.float64)])
def test_taking_the_hessian_in_place_gives_the_same_bits(k: int, dtype: torch.dtype) -> None:
    x = _inputs(rows=200, k=k, seed=k)
    stat = HessianStat.zeros(k, dtype)
    stat.update(x[:70])
    stat.update(x[70:])
    expected = stat.hessian()
    buffer = stat.gram.data_ptr()
    taken = stat.take_hessian()
    assert torch.equal(taken, expected) and taken.dtype == torch.float32
    assert dtype != torch.float32 or taken.data_ptr() == buffer  # made in the sum's own memory
    assert stat.count == 0
    with pytest.raises(CalibrationError):
        stat.take_hessian()


def test_act_merge_of_halves_equals_concatenation() -> None:
    x = _inputs()
    whole, first, second = ActStat.zeros(24), ActStat.zeros(24), ActStat.zeros(24)
    whole.update(x)
    first.update(x[:7])
    second.update(x[7:])
    merged = first.merge(second)
    assert merged.count == 40
    assert torch.allclose(merged.mean(), whole.mean(), rtol=1e-6, atol=1e-7)
    assert torch.allclose(whole.mean(), x.abs().mean(dim=0), rtol=1e-6, atol=1e-7)


def test_three_d_inputs_flatten_over_leading_dims() -> None:
    x = _inputs(rows=2 * 5, k=8).reshape(2, 5, 8)  # [batch, seq, K]
    flat_h, batched_h = HessianStat.zeros(8), HessianStat.zeros(8)
    flat_h.update(x.reshape(-1, 8))
    batched_h.update(x)
    assert batched_h.count == 10
    assert torch.equal(batched_h.xtx, flat_h.xtx)
    act = ActStat.zeros(8)
    act.update(x.to(torch.bfloat16))
    assert act.count == 10 and act.abs_sum.dtype == torch.float32
    assert torch.allclose(act.mean(), x.to(torch.bfloat16).float().abs().mean(dim=(0, 1)), rtol=1e-6)


def test_save_load_round_trip_is_exact(tmp_path: Path) -> None:
    h = HessianStat.zeros(16, torch.float64)
    h.update(_inputs(k=16))
    h.save(tmp_path / "h.safetensors")
    loaded = HessianStat.load(tmp_path / "h.safetensors")
    assert loaded.count == h.count and loaded.xtx.dtype == torch.float64
    assert torch.equal(loaded.xtx, h.xtx)

    a = ActStat.zeros(16)
    a.update(_inputs(k=16, seed=1))
    a.save(tmp_path / "a.safetensors")
    loaded_a = ActStat.load(tmp_path / "a.safetensors")
    assert loaded_a.count == a.count and torch.equal(loaded_a.abs_sum, a.abs_sum)
    with pytest.raises(QuantkitError, match="not a saved hessian"):
        HessianStat.load(tmp_path / "a.safetensors")


def test_mismatched_shapes_raise() -> None:
    with pytest.raises(QuantkitError, match="cannot merge"):
        HessianStat.zeros(8).merge(HessianStat.zeros(9))
    with pytest.raises(QuantkitError, match="cannot merge"):
        ActStat.zeros(8).merge(ActStat.zeros(9))
    with pytest.raises(QuantkitError, match="last dim 8"):
        HessianStat.zeros(8).update(torch.zeros(3, 9))


def test_empty_stat_cannot_be_divided() -> None:
    with pytest.raises(CalibrationError):
        HessianStat.zeros(4).hessian()
    with pytest.raises(CalibrationError):
        ActStat.zeros(4).mean()
