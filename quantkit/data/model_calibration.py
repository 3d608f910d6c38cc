"""The calibration windows a quantization run uses: a file from ``quantkit calibrate``, checked against the
model's tokenizer, or windows drawn from the shipped corpus (or the configured text) on the spot."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from quantkit.data.calibration import CalibrationConfig, CalibrationSet, build_calibration
from quantkit.errors import QuantkitError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def calibration_for_model(
    model: str | Path,
    config: CalibrationConfig,
    calibration_file: Path | None,
    tokenizer: PreTrainedTokenizerBase,
) -> CalibrationSet:
    """``calibration_file`` when given (made with this tokenizer), else windows built as ``config`` says."""
    from quantkit.model.resolve import tokenizer_fingerprint

    if calibration_file is None:
        return build_calibration(model, config, tokenizer=tokenizer).calibration
    calibration = CalibrationSet.load(Path(calibration_file))
    if calibration.metadata.get("tokenizer_hash") != tokenizer_fingerprint(tokenizer):
        raise QuantkitError(
            f"calibration file '{calibration_file}' was made with another tokenizer "
            f"({calibration.metadata.get('tokenizer', '?')}); "
            f"rebuild it with `quantkit calibrate --model {model}`"
        )
    if int(calibration.input_ids.max()) >= len(tokenizer):
        raise QuantkitError(f"calibration file '{calibration_file}' holds token ids outside the model's vocabulary")
    return calibration
