"""GPTQ's Hessian in one working buffer: the same bits as the straightforward chain, and no second [K, K] matrix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.matrices import spd

from quantkit.quantization.solvers import gptq_factor
from quantkit.quantization.solvers.gptq_factor import factor_in_place, fill_working


def _reference_factor(h: torch.Tensor) -> torch.Tensor:
    lower, _ = torch.linalg.cholesky_ex(h)
    upper, _ = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
    return upper


@pytest.mark.parametrize("k", [1, 97, 300])
def test_the_in_place_factor_is_bit_identical_in_values_and_layout(k: int) -> None:
    h = spd(k)
    expected = _reference_factor(h)
    buf = h.clone()
    u = factor_in_place(buf)
    assert u is not None and u.data_ptr() == buf.data_ptr()  # computed in the buffer's own memory
    assert torch.equal(u, expected) and u.stride() == expected.stride()


def test_a_matrix_that_is_not_positive_definite_gives_none() -> None:
    h = spd(16)
    h[3, 3] = -1.0
    assert factor_in_place(h.clone()) is None
    h[3, 3] = float("nan")
    assert factor_in_place(h.clone()) is None


def test_the_working_copy_equals_permute_then_isolate_dead_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gptq_factor, "_CHUNK_ELEMENTS", 50)  # several row chunks at K = 40
    h = spd(40)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    dead = torch.zeros(40, dtype=torch.bool)
    dead[[5, 17]] = True
    expected = h[perm][:, perm]
    expected[dead, :], expected[:, dead] = 0, 0
    expected[dead, dead] = 1
    assert torch.equal(fill_working(None, h, perm, dead), expected)
    reused = torch.full_like(h, float("nan"))
    assert torch.equal(fill_working(reused, h, perm, dead), expected) and torch.equal(h, spd(40))
    assert torch.equal(fill_working(None, h, None, torch.zeros(40, dtype=torch.bool)), h)


def _hwm_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset the peak")
def test_factoring_holds_no_second_matrix() -> None:
    k = 4096  # 67 MB in float32
    a = torch.rand(k, k, generator=torch.Generator().manual_seed(0))
    buf = a + a.T
    buf.diagonal().add_(2.0 * k)  # diagonally dominant: positive definite
    del a
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from the current one
    before = _hwm_kb()
    assert factor_in_place(buf) is not None
    grown_mb = (_hwm_kb() - before) / 1e3
    assert grown_mb < 0.5 * k * k * 4 / 1e6  # the chain on a row-major input would copy the whole matrix
