"""Data-free calibration: windows the model samples itself (``--dataset self``), seeded and shaped as asked."""

from __future__ import annotations

import pytest
import torch
from helpers.cli import run_cli

from quantkit.data.calibration import CalibrationConfig, CalibrationSet, build_calibration
from quantkit.errors import QuantkitError


def _windows(model, seed: int, **kw) -> torch.Tensor:
    config = CalibrationConfig(dataset="self", num_samples=3, seq_len=24, seed=seed, show_progress=False, **kw)
    return build_calibration(str(model), config).calibration.input_ids


def test_the_model_writes_seeded_windows_of_the_asked_shape(tiny_model_dir, tiny_bos_model_dir):
    first, again, other = _windows(tiny_model_dir, 0), _windows(tiny_model_dir, 0), _windows(tiny_model_dir, 1)
    assert first.shape == (3, 24) and torch.equal(first, again) and not torch.equal(first, other)
    assert len({tuple(row) for row in first.tolist()}) == 3  # sampled, not one greedy continuation
    with_bos = _windows(tiny_bos_model_dir, 0)
    assert with_bos.shape == (3, 24) and bool((with_bos[:, 0] == 1).all())  # BOS, then 23 generated tokens


def test_the_source_is_recorded_and_other_selections_are_refused(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "self.safetensors"
    args = ["calibrate", "-m", str(tiny_model_dir), "--dataset", "self", "--num-samples", "2", "--seq-len", "16"]
    code, _, err = run_cli([*args, "-o", str(out)], capsys)
    assert code == 0, err
    assert CalibrationSet.load(out).metadata["source"] == "self-generated"
    with pytest.raises(QuantkitError, match="--dataset self generates each window"):
        _windows(tiny_model_dir, 0, select="diverse")
