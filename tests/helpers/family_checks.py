"""One quantize run of a tiny model of a newer family, with the three logits its tests compare: the float model's
(transformers), the checkpoint's through quantkit's loader, and the checkpoint's through transformers' own
compressed-tensors loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from helpers.cli import run_cli
from quantkit.model.resolve import load_model


def quantized_logits(
    model: Path, out: Path, calib: Path, method: str, capsys: pytest.CaptureFixture[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float, quantkit-loaded, transformers-loaded) logits on the calibration windows after a W4 g32 run."""
    args = ["quantize", str(model), "-o", str(out), "--calib", str(calib), "--group-size", "32", "--method", method]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    ids = load_file(str(calib))["input_ids"].long()
    with torch.inference_mode():
        expected = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(input_ids=ids).logits
        ours = load_model(out)(input_ids=ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(input_ids=ids).logits
    return expected, ours, theirs


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Mean squared error over the expected logits' variance."""
    return float((actual - expected).square().mean() / expected.var())
