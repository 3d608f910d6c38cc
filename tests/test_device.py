"""The --device rule (quantkit.device): what auto resolves to, the one-line errors for a bad or missing device, and
the same rule in every command that takes the flag (exit 2, nothing written)."""

from __future__ import annotations

import pytest
import torch
from helpers.cli import run_cli

from quantkit.device import check_device_name, float64_device, resolve_device, supports_float64
from quantkit.errors import QuantkitError


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without CUDA, wherever the test runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_is_cuda_only_where_torch_sees_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(QuantkitError, match=r"'cuda:2' does not exist: torch sees 2 CUDA device\(s\), cuda:0..1"):
        resolve_device("cuda:2")


def test_cuda_without_cuda_names_the_problem_and_the_fix(no_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(QuantkitError) as info:
        resolve_device("cuda")
    message = str(info.value)
    assert "device 'cuda' is not available" in message and "CPU-only build" in message
    assert message.endswith("use device cpu or auto instead")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with pytest.raises(QuantkitError, match=r"sees no CUDA device .*CUDA_VISIBLE_DEVICES"):
        resolve_device("cuda:0")


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:x", "mps", "", 0])
def test_a_bad_name_lists_the_choices(name: object) -> None:
    with pytest.raises(QuantkitError, match=r"is invalid; use one of auto, cpu, cuda \(or cuda:N\)"):
        check_device_name(name)


def test_float64_work_moves_to_the_cpu_only_where_the_device_lacks_it() -> None:
    assert supports_float64(torch.device("cpu")) and supports_float64(torch.device("cuda"))
    assert not supports_float64(torch.device("mps"))
    assert float64_device(torch.device("mps")) == torch.device("cpu")
    assert float64_device(torch.device("cuda", 1)) == torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["quantize", "{model}", "-o", "{out}", "--method", "rtn"], "device 'cuda' is not available"),
        (["sensitivity", "{model}", "-o", "{out}", "--mode", "proxy"], "device 'cuda' is not available"),
        (["eval", "{model}"], "device 'cuda' is not available"),
        (["bench", "{model}"], "device 'cuda' is not available"),
    ],
)
def test_every_command_refuses_a_missing_cuda_in_one_line(
    command: list[str], message: str, tiny_model_dir, tmp_path, capsys, no_cuda: None
) -> None:
    out = tmp_path / "out"
    args = [a.format(model=tiny_model_dir, out=out) for a in command]
    code, _, err = run_cli([*args, "--device", "cuda"], capsys)
    assert code == 2 and message in " ".join(err.split()) and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 3  # one (soft-wrapped) red line
    assert not out.exists()


def test_serve_refuses_a_bad_device_before_loading(tiny_model_dir, capsys) -> None:
    code, _, err = run_cli(["serve", str(tiny_model_dir), "--device", "gpu"], capsys)
    assert code == 2 and "device 'gpu' is invalid; use one of auto, cpu, cuda" in " ".join(err.split())


def test_quantize_refuses_a_bad_device(tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", str(tiny_model_dir), "-o", str(out), "--device", "tpu"], capsys)
    assert code == 2 and "device 'tpu' is invalid" in " ".join(err.split())
    assert not out.exists()
