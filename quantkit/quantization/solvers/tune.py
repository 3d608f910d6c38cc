"""AutoRound-style block-output tuning (Cheng et al., 2023): after a block's linears are quantized, adjust their
integer rounding and group scales so that the quantized block reproduces the float block's output.

Parametrisation (per linear, starting codes ``q0`` and scales ``s``; zero points stay fixed)::

    codes = clamp(round_ste(q0 + V), qmin, qmax)        V in [-CODE_OFFSET, CODE_OFFSET], init 0
    w     = (codes - zero) * (s * M)[:, group(k)]       M in SCALE_RANGE per group, init 1 (tune_scales)

``round_ste`` rounds in the forward pass and passes the gradient straight through. ``q0`` is already an integer,
so ``V`` must pass +-0.5 to move a code: with ``|V| <= 1`` a code can reach either grid neighbour (RTN and GPTQ
codes lie within one step of the float weight), never two steps away. The codes are not re-rounded when ``M``
moves, so ``M`` rescales a whole group's dequantized values.

The loss is the mean squared error of the block's output against the caller's targets (the pipeline passes the
float model's own output at this block, so a block also makes up for the error of earlier ones, as AutoRound),
on ``batch_windows`` calibration windows per step drawn with a seeded generator, optimised by Adam (default)
or signed gradient descent with learning rates decaying linearly to 0 (AutoRound's schedule). The parameters
after the last step are kept: the rates have decayed to 0 there. (Keeping the step with the lowest batch loss, as
AutoRound does, picks a lucky window when a batch is one window, not better parameters; the comparison is in
docs/benchmarks.md.) At the end the returned weights (integer codes, scales rounded to the storage dtype: exactly
what the checkpoint stores) are scored on all windows and returned only when they score strictly lower than the
starting weights, so tuning never increases the block's calibration error. Losses are taken on outputs rounded
to the inputs' dtype, as the next block reads them; each step's batch loss relative to the starting weights' on
the same windows is kept as the history.

Adam is the default because it lowers the block-output error further than signed descent at the same learning
rates and step count; the comparison and the time tuning adds per block are in docs/benchmarks.md.

Everything runs in float32 on the block's device; no global RNG is touched; same inputs, same bits.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn

from quantkit.format.scheme import QuantizedWeight
from quantkit.quantization.solvers.grid import _round_scale

# |V| bound: codes move at most one grid step from their starting value (see the module docstring).
CODE_OFFSET = 1.0
# Bounds of the per-group scale multiplier M (it stops a diverging step; it is no clipping search): wide enough
# that tuned multipliers stay well inside them, so the bound hardly shapes the result.
SCALE_RANGE = (0.75, 1.25)
Optimizer = Literal["sign", "adam"]
OPTIMIZERS: tuple[str, ...] = ("sign", "adam")


class FunctionalRunner(Protocol):
    """What tuning needs of :class:`quantkit.model.blocks.BlockRunner` (solvers import no model code)."""

    batch_size: int

    def functional(self, block: nn.Module, params: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """The block on ``hidden`` [B, T, H] in float32, with ``params`` standing in for its tensors."""
        ...


class TuneSettings(Protocol):
    """The options tuning reads (``quantization/methods/tune.py`` holds them, with their defaults)."""

    steps: int
    lr: float  # rounding offsets V
    scale_lr: float  # scale multipliers M
    batch_windows: int  # calibration windows per step
    tune_scales: bool
    seed: int
    optimizer: Optimizer


@dataclass(slots=True)
class TuneResult:
    """One block's tuning. Losses: mean squared block-output error over all calibration windows (None when
    ``steps=0``, where nothing is evaluated)."""

    loss_before: float | None  # starting weights
    loss_after: float | None  # the returned weights: min(loss_before, loss_tuned)
    loss_tuned: float | None  # the tuned weights, whether kept or not
    steps: int  # optimisation steps run
    seconds: float
    kept: bool  # the tuned weights are returned (else the starting ones)
    codes_changed: float = 0.0  # fraction of the returned integer codes that differ from the starting ones
    history: list[float] = field(default_factory=list, repr=False)  # per step: batch loss / starting batch loss
    outputs: torch.Tensor | None = field(default=None, repr=False)  # with keep_outputs: see tune_block

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able summary (no history, no outputs)."""
        return {f: getattr(self, f) for f in _SUMMARY_FIELDS}


_SUMMARY_FIELDS = ("loss_before", "loss_after", "loss_tuned", "steps", "seconds", "kept", "codes_changed")


class _TunedLinear:
    """One linear's starting quantized weight and its learnable rounding offsets and scale multipliers."""

    def __init__(self, start: QuantizedWeight, tune_scales: bool, device: torch.device) -> None:
        self.start = start
        self.qmin, self.qmax = start.scheme.qmin, start.scheme.qmax
        # copies (float32, on the block's device): never inference tensors, so autograd may save them
        self.q0 = start.qweight.to(device=device, dtype=torch.float32, copy=True)
        self.scale = start.scale.to(device=device, dtype=torch.float32, copy=True)
        self.groups = start.column_groups().to(device)
        self.zero_cols = None if start.zero is None else start.zero.to(device).float()[:, self.groups]
        self.offset = torch.zeros_like(self.q0, requires_grad=True)
        self.mult = torch.ones_like(self.scale, requires_grad=True) if tune_scales else None

    def parameters(self) -> list[torch.Tensor]:
        return [self.offset] if self.mult is None else [self.offset, self.mult]

    def fake_weight(self) -> torch.Tensor:
        """Differentiable float32 [N, K] weight: rounding with a straight-through gradient."""
        x = self.q0 + self.offset
        codes = (x + (torch.round(x) - x).detach()).clamp(self.qmin, self.qmax)
        if self.zero_cols is not None:
            codes = codes - self.zero_cols
        scale = self.scale if self.mult is None else self.scale * self.mult
        return codes * scale.index_select(1, self.groups)

    def clip_(self) -> None:
        with torch.no_grad():
            self.offset.clamp_(-CODE_OFFSET, CODE_OFFSET)
            if self.mult is not None:
                self.mult.clamp_(*SCALE_RANGE)

    def snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.parameters()]

    def quantized(self, state: list[torch.Tensor], storage: torch.dtype) -> QuantizedWeight:
        """The integer weight for parameters ``state``: codes as in :meth:`fake_weight`, scales rounded to
        ``storage`` (untuned scales are returned as they were)."""
        device = self.start.qweight.device
        codes = torch.round(self.q0 + state[0]).clamp_(self.qmin, self.qmax).to(device=device, dtype=torch.int8)
        scale = self.start.scale
        if self.mult is not None:
            scale = _round_scale(self.scale * state[1], storage).to(device=scale.device, dtype=scale.dtype)
        start = self.start
        return QuantizedWeight(qweight=codes, scale=scale, zero=start.zero, g_idx=start.g_idx, scheme=start.scheme)


def _frozen_params(block: nn.Module) -> dict[str, torch.Tensor]:
    """The block's own tensors, detached (no gradient reaches the block); inference tensors are copied."""
    return {
        name: p.detach().clone() if p.is_inference() else p.detach()
        for name, p in block.named_parameters(remove_duplicate=False)
    }


def window_losses(
    block: nn.Module,
    runner: FunctionalRunner,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    weights: dict[str, QuantizedWeight],
) -> torch.Tensor:
    """float64 [n]: each window's mean squared block-output error with the linears ``weights`` dequantized."""
    return _evaluate(block, runner, inputs, targets, weights, keep_outputs=False)[0]


def _evaluate(
    block: nn.Module,
    runner: FunctionalRunner,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    weights: dict[str, QuantizedWeight],
    *,
    keep_outputs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-window losses (float64 [n]) of the block's outputs rounded to ``inputs``' dtype (as the next block
    reads them), and with ``keep_outputs`` those outputs (the same mini-batches and arithmetic as
    ``runner.run`` on a block holding the dequantized weights)."""
    params = _frozen_params(block)
    for name, weight in weights.items():
        target = params[f"{name}.weight"]
        params[f"{name}.weight"] = weight.dequantize(torch.float32).to(target.device)
    losses = torch.empty(inputs.shape[0], dtype=torch.float64)
    outputs = torch.empty(inputs.shape, dtype=inputs.dtype, device=inputs.device) if keep_outputs else None
    with torch.no_grad():
        for start in range(0, inputs.shape[0], runner.batch_size):
            stop = start + runner.batch_size
            out = runner.functional(block, params, inputs[start:stop]).to(inputs.dtype)
            if outputs is not None:
                outputs[start:stop] = out
            losses[start:stop] = _output_losses(out, targets[start:stop])
            del out
    return losses, outputs


def _output_losses(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """float64 [B] (on the CPU): each window's mean squared error of ``out`` (as stored) against ``targets``."""
    err = (out.float() - targets.to(out.device, torch.float32)).square_()
    return err.mean(dim=(1, 2)).cpu().double()  # float64 on the CPU: any device


def _stored_losses(outputs: torch.Tensor, targets: torch.Tensor, batch_size: int) -> torch.Tensor:
    with torch.no_grad():
        parts = [
            _output_losses(outputs[i : i + batch_size], targets[i : i + batch_size])
            for i in range(0, len(outputs), batch_size)
        ]
    return torch.cat(parts)


def tune_block(
    block: nn.Module,
    runner: FunctionalRunner,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    weights: dict[str, QuantizedWeight],
    config: TuneSettings,
    storage: torch.dtype,
    *,
    start_outputs: torch.Tensor | None = None,
    keep_outputs: bool = False,
) -> tuple[dict[str, QuantizedWeight], TuneResult]:
    """Tune the rounding (and scales) of ``weights`` to the block output; see the module docstring.

    ``block``: the decoder layer (its linears' current weights are not used: ``weights`` replace them);
    ``inputs`` [n, T, H]: its calibration inputs; ``targets`` [n, T, H]: the float block's outputs on them;
    ``weights``: linear path relative to the block -> starting quantized weight; ``storage``: the dtype
    the checkpoint stores scales in. Returns the weights to write (the tuned ones, or ``weights`` itself
    when tuning did not lower the error) and what happened.

    Two full forward passes can be saved: ``start_outputs`` [n, T, H], the block's outputs with the starting
    weights when the caller has them already (e.g. the quantized block's output), replaces evaluating them;
    with ``keep_outputs`` the result carries the block's outputs with the returned weights, in ``inputs``' dtype
    (bit for bit what ``runner.run`` gives on a block holding them: the next block's input). With it, up to two
    extra [n, T, H] buffers are held at a time.
    """
    began = time.perf_counter()
    if config.steps == 0 or not weights:
        return dict(weights), TuneResult(None, None, None, 0, time.perf_counter() - began, False)
    if inputs.shape[0] != targets.shape[0] or inputs.shape[0] == 0:
        raise ValueError(f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} must pair windows")
    device = next(iter(block.parameters())).device
    with torch.inference_mode(False), torch.enable_grad():
        if start_outputs is None:
            start_losses, start_outputs = _evaluate(block, runner, inputs, targets, weights, keep_outputs=keep_outputs)
        else:
            if start_outputs.shape != inputs.shape:
                raise ValueError(f"start_outputs {tuple(start_outputs.shape)} must match inputs {tuple(inputs.shape)}")
            start_losses = _stored_losses(start_outputs, targets, runner.batch_size)
        linears = {name: _TunedLinear(w, config.tune_scales, device) for name, w in weights.items()}
        final_state, history = _optimise(block, runner, inputs, targets, linears, start_losses, config)
        tuned = dict(weights)
        loss_before = float(start_losses.mean())
        loss_tuned, tuned_outputs = loss_before, None
        if final_state is not None:  # else a step's loss was not finite: the start is returned
            tuned = {name: lin.quantized(final_state[name], storage) for name, lin in linears.items()}
            tuned_losses, tuned_outputs = _evaluate(block, runner, inputs, targets, tuned, keep_outputs=keep_outputs)
            loss_tuned = float(tuned_losses.mean())
    kept = loss_tuned < loss_before
    changed = sum(int((tuned[n].qweight != w.qweight).sum()) for n, w in weights.items())
    result = TuneResult(
        loss_before=loss_before,
        loss_after=loss_tuned if kept else loss_before,
        loss_tuned=loss_tuned,
        steps=len(history),
        seconds=time.perf_counter() - began,
        kept=kept,
        codes_changed=changed / sum(w.qweight.numel() for w in weights.values()) if kept else 0.0,
        history=history,
        outputs=(tuned_outputs if kept else start_outputs) if keep_outputs else None,
    )
    return (tuned if kept else dict(weights)), result


def _optimise(
    block: nn.Module,
    runner: FunctionalRunner,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    linears: dict[str, _TunedLinear],
    start_losses: torch.Tensor,
    config: TuneSettings,
) -> tuple[dict[str, list[torch.Tensor]] | None, list[float]]:
    """The optimisation loop: the parameters after the last step (None when a step's loss was not finite)
    and each step's batch loss relative to the starting weights' on the same windows."""
    n = inputs.shape[0]
    batch = min(config.batch_windows, n)
    frozen = _frozen_params(block)
    offsets = [lin.offset for lin in linears.values()]
    mults = [lin.mult for lin in linears.values() if lin.mult is not None]
    groups: list[dict[str, Any]] = [{"params": offsets, "lr": config.lr}]
    if mults:
        groups.append({"params": mults, "lr": config.scale_lr})
    adam = torch.optim.Adam(groups) if config.optimizer == "adam" else None
    if adam is not None:
        groups = adam.param_groups  # the dicts whose "lr" Adam reads
    base_lrs = [group["lr"] for group in groups]
    gen = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(n, generator=gen)
    cursor = 0
    history: list[float] = []
    device = next(iter(frozen.values())).device
    for step in range(1, config.steps + 1):
        for group, base in zip(groups, base_lrs, strict=True):  # linear decay to 0 (AutoRound's schedule)
            group["lr"] = base * (1.0 - (step - 1) / config.steps)
        if cursor + batch > n:  # a fresh pass over the windows
            order, cursor = torch.randperm(n, generator=gen), 0
        idx = order[cursor : cursor + batch]
        cursor += batch
        params = dict(frozen)
        for name, lin in linears.items():
            params[f"{name}.weight"] = lin.fake_weight()
        out = runner.functional(block, params, inputs[idx].to(device))
        if inputs.dtype != out.dtype:  # scored as stored, like the full-data losses; gradient straight through
            out = out + (out.to(inputs.dtype).to(out.dtype) - out).detach()
        loss = (out - targets[idx].to(device, torch.float32)).square().mean()
        value, reference = float(loss.detach()), float(start_losses[idx].mean())
        if not math.isfinite(value):
            return None, history
        ratio = value / reference if reference > 0 else (1.0 if value == 0 else math.inf)
        history.append(ratio)
        loss.backward()
        del params, out, loss
        with torch.no_grad():
            if adam is not None:
                adam.step()
            else:
                for group in groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.sub_(p.grad.sign(), alpha=group["lr"])
        for group in groups:
            for p in group["params"]:
                p.grad = None
        for lin in linears.values():
            lin.clip_()
    return {name: lin.snapshot() for name, lin in linears.items()}, history
