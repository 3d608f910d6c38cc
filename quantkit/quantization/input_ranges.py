"""Static input scales calibrated on the calibration windows: the range of each stage's inputs, seen beside the
quantized block as it runs (a companion of the stage loop), turned into the scale a static input scheme stores
(FP8 / INT8 ``input_scale``, NVFP4's ``input_global_scale``).

Two observers, as llm-compressor names them: ``minmax`` (the largest magnitude over every calibration token,
its ``static_minmax``) and ``mse`` (the clipped range whose quantize-dequantize error over a sample of the inputs is
lowest). The sample is every n-th token row, so the search costs a bounded amount whatever the data size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from quantkit.format.input_quant import fake_quantize_input, static_input_scale
from quantkit.format.scheme import ActivationScheme
from quantkit.model.architectures import Stage
from quantkit.model.staged_block import StagedBlock

OBSERVERS = ("minmax", "mse")
OBSERVER_NAMES = {"minmax": "static_minmax", "mse": "mse"}  # as compressed-tensors records them
MSE_SAMPLE_ROWS = 2048  # token rows the MSE search measures errors on
MSE_SHRINKS = tuple(1.0 - i / 40 for i in range(21))  # the clipped ranges tried: 100% down to 50% of the max


@dataclass(slots=True)
class InputRange:
    """The inputs of one stage over the calibration windows: their largest magnitude and a row sample."""

    absmax: float
    sample: torch.Tensor  # [rows, K] float32, every n-th token row

    def scale(self, acts: ActivationScheme, dtype: torch.dtype, observer: str) -> torch.Tensor:
        """The static scale (float32 [1], rounded as stored) for inputs of this range under ``acts``."""
        best = static_input_scale(self.absmax, acts, dtype)
        if observer != "mse" or self.sample.numel() == 0:
            return best
        best_error = _error(self.sample, acts, best)
        for shrink in MSE_SHRINKS[1:]:
            candidate = static_input_scale(self.absmax * shrink, acts, dtype)
            error = _error(self.sample, acts, candidate)
            if error < best_error:
                best, best_error = candidate, error
        return best


def _error(sample: torch.Tensor, acts: ActivationScheme, scale: torch.Tensor) -> float:
    return float((fake_quantize_input(sample, acts, scale) - sample).square().sum())


class InputRangeObserver:
    """A stage-loop companion (see :class:`quantkit.quantization.methods.hooks.Companion`) that measures the
    quantized block's inputs stage by stage; ``sample_every`` keeps every n-th token row for the MSE search (0:
    no sample)."""

    def __init__(self, sample_every: int, first_row: int = 0) -> None:
        self.sample_every = sample_every
        self.first_row = first_row  # several processes: the index of this one's first token row of all
        self._absmax = 0.0
        self._rows: list[torch.Tensor] = []
        self._seen = first_row

    def open_stage(self, staged: StagedBlock, stage: Stage, in_features: int) -> Iterator[None]:
        self._absmax, self._rows, self._seen = 0.0, [], self.first_row
        for _ in staged.batches():
            yield None

    def observe(self, staged: StagedBlock, stage: Stage, rows: slice, inputs: torch.Tensor, own: None) -> None:
        flat = inputs.detach().reshape(-1, inputs.shape[-1])
        self._absmax = max(self._absmax, float(flat.abs().amax()))
        if self.sample_every:
            start = (-self._seen) % self.sample_every  # the global row index stays a multiple of the stride
            # a copy: the inputs may live in a buffer the next mini-batch overwrites (down_proj's), and on the CPU
            # neither .float() of float32 nor .cpu() copies
            self._rows.append(flat[start :: self.sample_every].to("cpu", torch.float32, copy=True))
        self._seen += flat.shape[0]

    def close_stage(self) -> InputRange:
        sample = torch.cat(self._rows) if self._rows else torch.empty(0, 0)
        found = InputRange(self._absmax, sample)
        self._rows = []
        return found

    def float_output(self) -> torch.Tensor:
        raise RuntimeError("an input observer follows the quantized block only: it has no float output")


def merge_ranges(ranges: list[InputRange]) -> InputRange:
    """The range of consecutive shares of the token rows (each process's, in row order): the largest magnitude,
    and the samples one after the other, as one observer over every row takes them."""
    samples = [r.sample for r in ranges if r.sample.numel()]
    sample = torch.cat(samples) if samples else torch.empty(0, 0)
    return InputRange(max(r.absmax for r in ranges), sample)


def sample_stride(total_rows: int, observer: str) -> int:
    """Every how many token rows the MSE search keeps one (0: the minmax observer keeps none)."""
    if observer != "mse":
        return 0
    return max(1, total_rows // MSE_SAMPLE_ROWS)
