"""GPTQ toward the float model's outputs (``--float-targets``; asymmetric calibration as in GPTAQ, Li et al.,
ICML 2025, plus the residual stream's own error).

Plain GPTQ fits each linear to its own float output on the quantized model's inputs ``x~``: it minimises
``sum ||W x~ - Q x~||^2``, so the error the earlier layers left in ``x~`` is taken as given. With float targets
it fits the float model's output on the float model's own inputs ``x`` instead: ``sum ||W x - Q x~||^2``. A
linear that writes the residual stream (o_proj, down_proj) also makes up for the error ``e = h~ - h`` the stream
already carries where its output is added: ``sum ||W x - e - Q x~||^2``, so that the block's output, not only
the linear's, follows the float model. With ``H = sum x~ x~^T``, ``C = sum x x~^T`` and ``E = sum e x~^T``
that loss is

    sum ||W x - e - W* x~||^2 + tr((Q - W*) H (Q - W*)^T),     W* = (W C - E) H^-1,

so GPTQ run on the target ``W*`` with the usual Hessian ``H`` minimises it exactly. The target is damped more than
GPTQ damps ``H``, by ``lambda = (damp + ridge) * mean(diag H)``, and the damping pulls towards ``W``, not towards
0: the target solves ``min sum ||W x - e - Q x~||^2 + lambda ||Q - W||^2``, which is
``W* = W + (W (C - H) - E)(H + lambda I)^-1`` (``W`` itself where the two streams agree, as at the first block's
first stage).

The targets are a regression on the calibration tokens, so they overfit a small calibration set: they need more
windows than GPTQ does, and the ridge (``FloatTargetsConfig.ridge``, default ``TARGET_RIDGE``) shrinks them
towards plain GPTQ's target, which lowered the KL on held-out text of the calibration's author and of another
author (the figures are in docs/benchmarks.md, "Measurements behind the defaults").

The float inputs come from a copy of the block taken before any of its linears is quantized, run stage by stage
on the float model's activations in step with the quantized block (:class:`FloatPath`); its output is the float
model's output at this block (the next block's float input, and tuning's targets), computed on the way.

A mixture-of-experts block: each expert linear's moments are summed over the rows its Hessian sums (``--moe-calibration
all``: every token; ``routed``: the tokens the quantized block routes to the expert, the float inputs taken on those
same rows), and the float block's output is the float MoE's own forward (routed by the float router on the float
inputs). The experts' outputs reach the residual stream scaled by routing weights (and the shared expert's by its
sigmoid gate), so no expert's down_proj takes the stream's error ``e``: o_proj alone corrects it there.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.model.architectures import DOWN, ArchSpec, Stage
from quantkit.model.blocks import BlockRunner, get_module
from quantkit.model.staged_block import StagedBlock
from quantkit.model.staged_moe import ALL
from quantkit.quantization.methods.hooks import BlockWork, Companion, Hooks, JobView, SolveJob
from quantkit.quantization.methods.registry import Capabilities, Role, Switch, option, register

_MIN_DAMP = 1e-4  # with --damp 0: some damping, so that a singular Hessian still factors
# The targets' own damping beside GPTQ's: a regression of the float outputs on the calibration tokens overfits them,
# and this ridge chose the best out-of-domain figure of the sweep (docs/benchmarks.md, "Measurements behind the
# defaults")
TARGET_RIDGE = 0.2
_DAMP_TRIES = 4


class FloatPath:
    """The float block on the float model's activations, stage by stage: the float inputs of each stage, and the
    block's float output once the last stage has run."""

    def __init__(
        self, block: nn.Module, arch: ArchSpec, runner: BlockRunner, reference: torch.Tensor, moe_calibration: str = ALL
    ) -> None:
        # a copy: the quantized block's linears are overwritten with their dequantized weights stage by stage
        copied = copy.deepcopy(block)
        self.staged = StagedBlock(copied, arch, runner, reference.clone(), moe_calibration=moe_calibration)
        self._down = None if arch.moe is not None else get_module(self.staged.block, arch.stage(DOWN).head)
        self._output_ready = False
        self._moe_output: torch.Tensor | None = None

    def follow(self, quantized: StagedBlock) -> None:
        """Take an expert's routed rows from the ``quantized`` block's selections (routed MoE calibration), so each
        expert's float inputs cover the rows its Hessian sums."""
        if self.staged.experts is not None:
            self.staged.experts.follow = quantized.experts

    def stage_inputs(self, stage: str) -> Iterator[torch.Tensor]:
        """Float32 inputs [b, T, K] of ``stage``'s linears, mini-batch by mini-batch (the quantized block's).

        For the down stage each batch's output ``h2 + down(a)`` is written over ``h2`` once the caller asks for
        the next batch (it may read ``h2`` through ``staged.residual_in`` until then), so the block's output
        costs one down_proj product per batch instead of a second MLP pass.
        """
        if stage != DOWN:  # a mixture of experts has no "down" stage: its output is the float MoE's forward
            yield from self.staged.stage_inputs(stage)
            return
        assert self._down is not None
        hidden = self.staged.hidden
        for rows, a in zip(self.staged.batches(), self.staged.stage_inputs(stage), strict=True):
            yield a
            h2 = self.staged.residual_in(DOWN, rows)
            assert h2 is not None
            with self.staged.runner.precision():
                down = self._down(a)
            hidden[rows] = (h2.float() + down).to(hidden.dtype)
        self._output_ready = True

    def output(self) -> torch.Tensor:
        """The float block's output for every sample (the reference stream's dtype), after the down stage (the last
        expert stage of a mixture of experts, whose MLP then runs once more, routed by its own router)."""
        if self.staged.experts is not None:
            if self._moe_output is None:
                self._moe_output = self.staged.output()
            return self._moe_output
        assert self._output_ready, "the down stage must run to its end before the float output is read"
        return self.staged.hidden


class StageMoments:
    """What the float targets of one stage's linears need beyond its Hessian, summed over the calibration tokens.

    Two ways to the same numbers, the cheaper one per stage: either ``gap = sum (x - x~) x~^T`` [K, K] (shared by
    the stage's linears; it is ``C - H``, summed from the differences so that no two large sums are subtracted)
    and, for a stage that writes the residual stream, ``residual = sum e x~^T`` [N, K], with ``e = h~ - h`` the
    quantized stream's error where the stage's output is added; or, given the linears' float weights, each
    linear's ``shift = sum (W (x - x~) - e) x~^T`` [N, K] directly. Per token the first costs ``K^2`` (+ ``N K``),
    the second ``2 N K`` for each linear: for down_proj (K = intermediate size, N = hidden size) the shift is
    cheaper.

    ``product_dtype`` bfloat16 (``--compute-dtype bfloat16``): each mini-batch's products are taken in bfloat16 and
    added to the float32 sums. Every product has a difference as a factor, so bfloat16's rounding is relative to
    the moment itself, not to the activations it is the small difference of.
    """

    def __init__(
        self,
        k: int,
        device: torch.device,
        weights: dict[str, torch.Tensor] | None = None,
        dtype: torch.dtype = torch.float32,
        product_dtype: torch.dtype | None = None,
    ) -> None:
        self.weights = weights  # name -> float weight [N, K]: accumulate shifts (see the class docstring)
        self.dtype, self.k, self.device = dtype, k, device  # of the sums
        self.product_dtype = product_dtype or dtype
        self.gap: torch.Tensor | None = None
        self.residual: torch.Tensor | None = None
        self.shifts: dict[str, torch.Tensor] = {}
        self._fresh()
        self.count = 0

    def _zeros(self, rows: int) -> torch.Tensor:
        with torch.inference_mode(False):  # a normal tensor: the sums are added up in place after the stage
            return torch.zeros(rows, self.k, device=self.device, dtype=self.dtype)

    def _fresh(self) -> None:
        """Zero sums (the residual's is made at its first use: only a stage that writes the stream has one)."""
        self.gap = None if self.weights is not None else self._zeros(self.k)
        self.residual = None
        self.shifts = {n: self._zeros(w.shape[0]) for n, w in (self.weights or {}).items()}

    def take_chunk(self) -> dict[str, torch.Tensor]:
        """The sums so far, by name; later tokens are summed into fresh buffers (the block loop adds the chunks up
        in the Hessians' fixed order)."""
        out = {f"shift:{name}": shift for name, shift in self.shifts.items()}
        if self.gap is not None:
            out["gap"] = self.gap
        if self.residual is not None:
            out["residual"] = self.residual
        self._fresh()
        return out

    def put_totals(self, totals: dict[str, torch.Tensor], count: int) -> None:
        """Replace the sums by ``totals`` (:meth:`take_chunk`'s names), over ``count`` token rows."""
        self.gap, self.residual = totals.get("gap"), totals.get("residual")
        self.shifts = {name.removeprefix("shift:"): v for name, v in totals.items() if name.startswith("shift:")}
        self.count = count

    @staticmethod
    def direct_is_cheaper(k: int, out_features: list[int]) -> bool:
        return 2 * sum(out_features) < k

    def _add_product(self, total: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
        """``total += left^T right``, the product in ``product_dtype`` (``right`` is already in it)."""
        if self.product_dtype == total.dtype:
            total.addmm_(left.T, right)
        else:
            total.add_(left.T.to(self.product_dtype) @ right)

    def add(self, float_inputs: torch.Tensor, inputs: torch.Tensor, residual_error: torch.Tensor | None = None) -> None:
        k, dtype = inputs.shape[-1], self.dtype
        x = inputs.reshape(-1, k).to(dtype)
        e = None if residual_error is None else residual_error.reshape(x.shape[0], -1).to(dtype)
        delta = float_inputs.reshape(-1, k).to(dtype) - x  # x - x~
        x_product = x.to(self.product_dtype)
        if self.weights is not None:
            delta_product = delta.to(self.product_dtype)
            for name, weight in self.weights.items():
                target_gap = (delta_product @ weight.T.to(self.product_dtype)).to(dtype)  # W (x - x~): [tokens, N]
                if e is not None:
                    target_gap -= e
                self._add_product(self.shifts[name], target_gap, x_product)
        else:
            assert self.gap is not None
            self._add_product(self.gap, delta, x_product)
            if e is not None:
                if self.residual is None:
                    self.residual = self._zeros(e.shape[1])
                self._add_product(self.residual, e, x_product)
        self.count += x.shape[0]

    def normalise_(self) -> None:
        """Divide as GPTQ's Hessian is divided: ``2 / n`` (out of place: the sums may be inference tensors); no rows
        (an expert no token was routed to): nothing to divide."""
        if self.count == 0:
            return
        scale = 2.0 / self.count
        if self.gap is not None:
            self.gap = self.gap * scale
        if self.residual is not None:
            self.residual = self.residual * scale
        self.shifts = {name: shift * scale for name, shift in self.shifts.items()}

    def shift(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """float64 ``W (C - H) - E`` [N, K] of the linear ``name`` (float weight ``weight``), normalised as GPTQ's
        Hessian."""
        if name in self.shifts:
            return self.shifts[name].double()
        assert self.gap is not None, f"no moments were kept for {name}"
        out = weight.double() @ self.gap.double()
        if self.residual is not None:
            out -= self.residual.double()
        return out


def float_target(weight: torch.Tensor, hessian: torch.Tensor, shift: torch.Tensor, damp: float) -> torch.Tensor:
    """``W + shift (H + lambda I)^-1`` with ``shift = W (C - H) - E`` (:meth:`StageMoments.shift`; see the module
    docstring), float32 like ``weight``.

    ``hessian`` and ``shift`` share a normalisation (GPTQ's ``2 / n``); solved in float64. A Hessian with no
    signal (all zero), or one no damping makes factorable, leaves ``weight`` as it is.
    """
    h = hessian.double()
    mean_diag = float(torch.diagonal(h).mean())
    if not mean_diag > 0:
        return weight
    relative = max(damp, _MIN_DAMP)
    for _ in range(_DAMP_TRIES):  # as GPTQ: more damping until the factorisation succeeds
        damped = h.clone()
        damped.diagonal().add_(relative * mean_diag)
        factor, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            correction = torch.cholesky_solve(shift.double().T, factor).T  # shift @ damped^-1 (damped: symmetric)
            return (weight.double() + correction).to(weight.dtype)
        relative *= 10.0
    return weight


@dataclass(frozen=True)
class FloatTargetsConfig:
    """GPTQ fits the float model's outputs on its own inputs, plus the residual stream's error (the module
    docstring); the targets damped with GPTQ's own damping plus ``ridge``."""

    ridge: float = option(
        TARGET_RIDGE,
        "Damping of the float targets added to GPTQ's (a fraction of the mean Hessian diagonal): it pulls each target "
        "towards the float weight, plain GPTQ's target, so that the regression fits the calibration tokens less "
        "closely.",
        cli=False,
    )

    def __post_init__(self) -> None:
        if not self.ridge >= 0:
            raise QuantkitError(f"the float targets' ridge must be >= 0 (default {TARGET_RIDGE}), got {self.ridge}")


class FloatCompanion:
    """The float path beside the quantized block, and the moments each stage's targets need."""

    def __init__(self, path: FloatPath) -> None:
        self.path = path
        self.moments: StageMoments | None = None
        self._totals = False  # the block loop handed this stage's sums over every mini-batch

    def take_chunk(self) -> dict[str, torch.Tensor]:
        assert self.moments is not None
        return self.moments.take_chunk()

    def put_totals(self, totals: dict[str, torch.Tensor] | None, count: int) -> None:
        assert self.moments is not None
        if totals is not None:  # None: another process solves this stage
            self.moments.put_totals(totals, count)
            self._totals = True

    def open_stage(self, staged: StagedBlock, stage: Stage, in_features: int) -> Iterator[torch.Tensor]:
        linears = {name: get_module(staged.block, name) for name in stage.linears}
        if StageMoments.direct_is_cheaper(in_features, [linear.out_features for linear in linears.values()]):
            weights = {name: linear.weight for name, linear in linears.items()}
        else:
            weights = None
        self.moments = StageMoments(
            in_features, staged.hidden.device, weights, product_dtype=staged.runner.compute_dtype
        )
        self.path.follow(staged)
        return self.path.stage_inputs(stage.name)

    def observe(self, staged: StagedBlock, stage: Stage, rows: slice, inputs: torch.Tensor, own: torch.Tensor) -> None:
        assert self.moments is not None
        residual, float_residual = staged.residual_in(stage.name, rows), self.path.staged.residual_in(stage.name, rows)
        error = None if residual is None or float_residual is None else residual.float() - float_residual.float()
        self.moments.add(own, inputs, error)

    def close_stage(self) -> StageMoments:
        assert self.moments is not None
        moments, self.moments = self.moments, None
        if self._totals:
            moments.normalise_()
        self._totals = False
        return moments

    def float_output(self) -> torch.Tensor:
        return self.path.output()


class _Hooks(Hooks):
    def prepare(self, config: Any, job: JobView) -> None:
        if job.arch.sandwich_norms is not None:
            raise QuantkitError(
                f"--float-targets is not defined for {job.arch.family}: a norm on each sub-block's output "
                f"({', '.join(job.arch.sandwich_norms)}) stands between the solved linears and the residual stream "
                "whose error the targets correct; drop --float-targets"
            )

    def companion(self, config: Any, work: BlockWork) -> Companion:
        # a float copy, before any linear is quantized
        return FloatCompanion(FloatPath(work.block, work.arch, work.runner, work.float_input, work.moe_calibration))

    def target_weights(self, config: Any, solver: Any, job: SolveJob, stage_data: Any) -> list[torch.Tensor]:
        hessian = job.hessian
        assert hessian is not None, "float targets need the stage's Hessian"
        if stage_data.count == 0:  # no calibration row (an expert never routed to): round-to-nearest, as GPTQ does
            return job.weights
        return [
            float_target(w, hessian, stage_data.shift(name, w), solver.damp + config.ridge)
            for name, w in zip(job.names, job.weights, strict=True)
        ]


SWITCH = Switch(
    "flag",
    flag="--float-targets",
    help="GPTQ: fit each linear to the float model's outputs (and the residual stream's error), not to its "
    "own outputs on the quantized inputs (GPTAQ); a regression on the calibration tokens: use 256 windows, "
    "and --rotate hadamard (unrotated outlier channels make it worse than plain GPTQ).",
)
CAPS = Capabilities(needs_float_path=True, requires=("gptq",))
SUMMARY = "float targets: GPTQ fits the float model's outputs on its own inputs (GPTAQ)"
ALGORITHM = register(
    "float_targets", FloatTargetsConfig, Role.TARGET, _Hooks(), switch=SWITCH, caps=CAPS, summary=SUMMARY
)
