"""The kernel self-check behind the engine's backend choice: every kernel passes against its reference (on CPU under
the Triton interpreter), and a kernel that raises or computes wrong values makes ``auto`` fall back to torch with
one warning naming it."""

from __future__ import annotations

import warnings

import pytest
import torch
import triton  # noqa: F401 (the gpu extra, installed in CI: the kernels' tests never skip)

from quantkit.runtime import attention_backend
from quantkit.runtime.kernels import quant_matmul, rmsnorm, selfcheck

CUDA0 = torch.device("cuda", 0)  # an explicit index: the selection tests never touch a real GPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_kernel_passes_its_check(device, dtype):
    result = selfcheck.run_checks(torch.device(device), dtype)
    assert [c.kernel for c in result.checks] == list(selfcheck.CHECKS)
    assert result.usable and result.failed == [], result.failed
    for name, check in selfcheck.CHECKS.items():
        assert check(torch.device(device), dtype) <= selfcheck.TOLERANCE[dtype] / 4, name  # margin over rounding


def test_a_kernel_that_raises_is_reported_by_name(device, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed\nfull compiler log")

    monkeypatch.setattr(rmsnorm, "rmsnorm", broken)
    result = selfcheck.run_checks(torch.device(device), torch.float32)
    assert not result.usable and [c.kernel for c in result.failed] == ["rmsnorm"]
    assert result.failed[0].error == "RuntimeError: PassManager::run failed"  # the first line only


def test_a_kernel_that_computes_wrong_values_is_reported_by_name(device, monkeypatch):
    real = quant_matmul.quant_matmul
    monkeypatch.setattr(quant_matmul, "quant_matmul", lambda *a, **k: real(*a, **k) * 1.1)  # 10% off
    result = selfcheck.run_checks(torch.device(device), torch.float32)
    assert [c.kernel for c in result.failed] == ["quant_matmul"]
    assert result.failed[0].error.startswith("error 0.1")


def test_nan_fails_the_check():
    assert selfcheck._rel_err(torch.tensor([1.0, float("nan")]), torch.ones(2)) == float("inf")


def _fake_checks(monkeypatch, failing: str | None) -> list[str]:
    """Checks that pass (error 0) except ``failing``, which raises; returns the list of kernels run."""
    ran: list[str] = []

    def make(name):
        def check(device, dtype):
            ran.append(name)
            if name == failing:
                raise RuntimeError(f"{name} failed to compile")
            return 0.0

        return check

    monkeypatch.setattr(selfcheck, "CHECKS", {name: make(name) for name in selfcheck.CHECKS})
    monkeypatch.setattr(selfcheck, "_CACHE", {})
    monkeypatch.setattr(selfcheck, "default_dtype", lambda device: torch.float16)
    monkeypatch.setattr(attention_backend, "triton_available", lambda: True)
    return ran


def test_auto_falls_back_to_torch_with_one_warning_naming_the_kernel(monkeypatch):
    _fake_checks(monkeypatch, failing="paged_attention")
    with pytest.warns(RuntimeWarning) as caught:
        backend = attention_backend.select_backend("auto", CUDA0)
    assert backend.name == "torch"
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    message = str(caught[0].message)
    assert "paged_attention (RuntimeError: paged_attention failed to compile)" in message and "torch" in message
    assert "quant_matmul" not in message


def test_auto_picks_triton_when_every_kernel_passes_and_checks_once_per_device(monkeypatch):
    ran = _fake_checks(monkeypatch, failing=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert attention_backend.select_backend("auto", CUDA0).name == "triton"
        assert attention_backend.select_backend("auto", CUDA0).name == "triton"
    assert ran == list(selfcheck.CHECKS)  # the second engine on the device reuses the first check
    assert attention_backend.select_backend("torch", CUDA0).name == "torch"


def test_the_cpu_never_runs_the_check(monkeypatch):
    ran = _fake_checks(monkeypatch, failing="rmsnorm")
    assert attention_backend.select_backend("auto", torch.device("cpu")).name == "torch"
    assert ran == []
