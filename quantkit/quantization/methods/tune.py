"""Block-output tuning (AutoRound-style, Cheng et al., 2023): after a block's linears are solved, their integer
rounding and group scales are adjusted so that the quantized block reproduces the float block's output; the math
is :mod:`quantkit.quantization.solvers.tune`. Kept only where it lowers the block's calibration error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from quantkit.errors import QuantkitError
from quantkit.quantization.methods.hooks import BlockWork, Hooks
from quantkit.quantization.methods.records import kind_dict
from quantkit.quantization.methods.registry import Capabilities, Role, Switch, option, register
from quantkit.quantization.solvers.tune import OPTIMIZERS, Optimizer, tune_block

# Learning rates at the start of the linear decay, the same for any number of steps: rates that shrink with the
# step count made more steps worthless, and higher rates fit each block better without helping the whole model
# (the sweeps are in docs/benchmarks.md, "Measurements behind the defaults").
OFFSET_LR = 0.03
SCALE_LR = 0.015


@dataclass(frozen=True)
class TuneConfig:
    """Block-output tuning of the rounding and scales."""

    steps: int = option(100, "Block-output tuning of rounding and scales after the solver: steps per block (0: off).")
    lr: float = option(OFFSET_LR, "Tuning: Adam learning rate of the rounding offsets (decays linearly to 0).")
    scale_lr: float = option(SCALE_LR, "Tuning: Adam learning rate of the group-scale multipliers.")
    batch_windows: int = option(1, "Tuning: calibration windows per step.")
    tune_scales: bool = option(True, "Tune the group scales as well as the rounding.", cli=False)
    seed: int = option(0, "Seed of the order the windows are drawn in.", cli=False)
    optimizer: Optimizer = option("adam", "adam, or sign (signed gradient descent, as AutoRound).", cli=False)

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise QuantkitError(f"--tune-steps must be >= 0 (0 turns tuning off), got {self.steps}")
        if self.batch_windows < 1:
            raise QuantkitError(f"--tune-batch-windows must be >= 1, got {self.batch_windows}")
        if not self.lr > 0:
            raise QuantkitError(f"--tune-lr must be positive (default {OFFSET_LR}), got {self.lr}")
        if not self.scale_lr > 0:
            raise QuantkitError(f"--tune-scale-lr must be positive (default {SCALE_LR}), got {self.scale_lr}")
        if self.optimizer not in OPTIMIZERS:
            raise QuantkitError(f"unknown tuning optimizer {self.optimizer!r}; use one of {list(OPTIMIZERS)}")


@dataclass(slots=True)
class TuneRecord:
    """Block-output tuning of one block (``name``: its prefix): mean squared output errors on the calibration
    windows before and after, and whether the tuned weights were kept. No timings: a resumed run's log must
    equal an uninterrupted one's."""

    KIND: ClassVar[str] = "tune"
    name: str
    loss_before: float
    loss_after: float
    steps: int
    kept: bool

    def to_dict(self) -> dict[str, Any]:
        return kind_dict(self)


class _Hooks(Hooks):
    def tune(self, config: Any, work: BlockWork) -> list[Any]:
        """Tune the solved block's rounding and scales to its float output; the block, its weights and its output
        (the next block's input) become the tuned ones when they lower the error."""
        assert work.kept_input is not None and work.reference_output is not None
        weights, result = tune_block(
            work.block,
            work.runner,
            work.kept_input,
            work.reference_output,
            work.weights,
            config,
            work.storage,
            start_outputs=work.output,
            keep_outputs=True,
        )
        for name, weight in weights.items():
            work.write_back(name, weight)
        work.weights, work.output = weights, result.outputs
        assert result.loss_before is not None and result.loss_after is not None
        return [TuneRecord(work.prefix, result.loss_before, result.loss_after, result.steps, result.kept)]


SWITCH = Switch("field", field="steps", off=0)
CAPS = Capabilities(needs_float_path=True, reads_solved_block=True, records=(TuneRecord,))
SUMMARY = "block-output tuning: rounding and scales fitted to the float block's output"
ALGORITHM = register("tune", TuneConfig, Role.TUNE, _Hooks(), switch=SWITCH, caps=CAPS, summary=SUMMARY)
