"""Fused add + RMSNorm (Triton, interpreter on CPU) vs the torch reference.

Tolerance: new_residual must match exactly (one rounding of an fp32 sum); normed within 1 ulp of the output
dtype: atol=rtol=1e-5 (fp32), 1e-3 (fp16), 8e-3 (bf16) (only the fp32 reduction order differs).
Interpreter exception: Triton's CPU interpreter rounds fp32 -> bf16 toward zero (GPUs round to nearest even), so
under the interpreter bf16 gets 3e-2 for normed (two truncations, up to ~3 ulp) and 1 ulp for new_residual.
"""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401 (the gpu extra, installed in CI: the kernels' tests never skip)

from quantkit.runtime.kernels.backend import triton_available
from quantkit.runtime.kernels.rmsnorm import rmsnorm, rmsnorm_reference

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("hidden", [64, 96])
def test_matches_reference(device, dtype, with_residual, hidden):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, hidden, generator=gen) * 3).to(device=device, dtype=dtype)
    residual = torch.randn(2, 3, hidden, generator=gen).to(device=device, dtype=dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device=device, dtype=dtype)
    out, new_res = rmsnorm(x, residual, weight, 1e-6)
    ref, ref_res = rmsnorm_reference(x, residual, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.bfloat16 and device == "cpu":  # interpreter truncates fp32 -> bf16
        torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(new_res, ref_res, atol=0.0, rtol=2**-7)
    else:
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
        assert torch.equal(new_res, ref_res)
    if residual is None:
        assert new_res is x


def test_rejects_bad_inputs(device):
    x = torch.randn(2, 32, device=device)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(x, None, torch.ones(31, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rmsnorm(x, torch.randn(3, 32, device=device), torch.ones(32, device=device), 1e-6)
    with pytest.raises(ValueError, match="x must be"):
        rmsnorm(x.long(), None, torch.ones(32, device=device), 1e-6)


def test_backend_reports_triton_usable():
    assert triton_available()  # CUDA present, or the interpreter was enabled by conftest
