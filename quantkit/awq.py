"""AWQ (Lin et al., 2023): activation-aware per-channel scaling, then weight clipping, one decoder block at a time.

For each scaling group ``prev -> linears`` (see :class:`~quantkit.architectures.ScalingGroup`) a scale ``s`` per
input channel is searched on a grid of ratios ``r``: ``s = x_mean**r / w_mean**(1 - r)`` (``x_mean**r`` without
duo scaling), normalised by ``sqrt(max(s) * min(s))``. A candidate is scored by fake-quantizing ``W * s`` and
dividing by ``s`` again, then measuring the squared error of an *inspected output* against the float output:

* ``objective="module"`` (default, as AutoAWQ): the output of the module the group feeds, i.e. the linears'
  common parent (``self_attn`` for q/k/v, ``mlp`` for gate/up), run on its captured calibration inputs; for a
  one-linear group (``o_proj``, ``down_proj``) the linear's own output, computed exactly from the input Gram
  matrix ``X^T X``: ``sum((dW @ G) * dW)``, whose cost does not depend on the number of tokens.
* ``objective="linear"`` (the paper's Eq. 4): the sum over the group's linears of their own output errors, all
  through Gram matrices (cheapest; ignores attention / gating non-linearities).

Plain RTN (``s = 1``) is always the first candidate and a ratio replaces it only with a strictly lower error, so
the search never does worse than RTN on its data. The chosen scales are folded into ``prev`` (a norm's weight, or a
linear's output rows) and multiplied into the linears' input columns: the float block computes the same function.

Clipping then shrinks, per output row and quantization group, the weight range by the factor (1.0 down to
``max_shrink``) that minimises the group's output contribution error ``||X_g (W_g - Q(clamp(W_g)))^T||^2``,
evaluated exactly through the per-group block-diagonal Gram matrices; q/k projections are never clipped.

Searches quantize with the linear's scheme minus ``mse_clip`` (the final RTN/GPTQ pass applies it), with scales
rounded to ``scale_dtype`` as the checkpoint will store them.

Cost (SmolLM2-shaped block, one CPU thread): ~2 s with ``objective="linear", search_samples=8`` and ~2.8 s with
``objective="module", search_samples=2``; the module objective grows linearly with ``search_samples``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.architectures import ArchSpec, ScalingGroup
from quantkit.block_io import BlockRunner, get_module
from quantkit.errors import QuantkitError
from quantkit.grid import compute_qparams
from quantkit.scheme import QuantScheme
from quantkit.stats import ActStat

Objective = Literal["module", "linear"]
QRange = tuple[torch.Tensor, torch.Tensor]  # per-row (lo, hi) [R, 1]
LossFn = Callable[[Sequence[torch.Tensor]], float]  # candidate dequantized weights (one per linear) -> error

_NO_CLIP = ("q_proj", "k_proj")  # clipping the query/key projections hurts attention
_CHUNK_ELEMENTS = 1 << 24  # clip search: floats per vectorised chunk (64 MiB)


@dataclass(slots=True)
class AWQConfig:
    grid: int = 20  # ratios r = i / grid, i = 0 .. grid-1
    duo_scaling: bool = True  # s = x_mean**r / w_mean**(1-r); else x_mean**r
    clip: bool = True
    clip_grid: int = 20  # shrink factors 1 - i / clip_grid, from 1.0 down to max_shrink
    max_shrink: float = 0.5
    search_samples: int | None = None  # use only the first N calibration samples for the searches
    objective: Objective = "module"
    clip_tokens: int = 4096  # clip search: at most this many (evenly strided) input tokens

    def __post_init__(self) -> None:
        if self.grid < 1 or self.clip_grid < 1:
            raise QuantkitError(f"AWQ grids must be >= 1 (grid={self.grid}, clip_grid={self.clip_grid})")
        if not 0.0 < self.max_shrink <= 1.0:
            raise QuantkitError(f"AWQ max_shrink must be in (0, 1], got {self.max_shrink}")
        if self.search_samples is not None and self.search_samples < 1:
            raise QuantkitError(f"AWQ search_samples must be >= 1 or None, got {self.search_samples}")
        if self.objective not in ("module", "linear"):
            raise QuantkitError(f"AWQ objective must be 'module' or 'linear', got {self.objective!r}")
        if self.clip_tokens < 1:
            raise QuantkitError(f"AWQ clip_tokens must be >= 1, got {self.clip_tokens}")


@dataclass(slots=True)
class ScaleSearchResult:
    scales: torch.Tensor  # float32 [K]; all ones when no ratio beat RTN
    ratio: float | None  # None: identity scales (plain RTN) won
    rtn_error: float  # inspected-output MSE with s = 1
    error: float  # inspected-output MSE with the chosen scales
    errors: list[tuple[float, float]] = field(default_factory=list)  # (ratio, error) for every grid point


@dataclass(slots=True)
class ClipResult:
    max_val: torch.Tensor  # float32 [N, G]: clamp bound per output row and group
    shrink: torch.Tensor  # float32 [N, G]: chosen fraction of the original abs max
    error_before: float  # output MSE summed over groups, per token and output row, without clipping
    error_after: float

    @property
    def mean_shrink(self) -> float:
        return float(self.shrink.mean())


@dataclass(slots=True)
class GroupReport:
    prev: str
    linears: tuple[str, ...]
    ratio: float | None  # None: identity scales kept
    rtn_error: float  # inspected-output MSE, plain RTN
    awq_error: float  # inspected-output MSE, chosen scales
    inspected: str  # module whose output was scored ("" : linear outputs via Gram matrices)


@dataclass(slots=True)
class ClipReport:
    linear: str
    mean_shrink: float
    error_before: float
    error_after: float


@dataclass(slots=True)
class AWQBlockReport:
    groups: list[GroupReport] = field(default_factory=list)
    skipped: list[ScalingGroup] = field(default_factory=list)  # shapes do not allow folding (e.g. GQA v -> o)
    clips: list[ClipReport] = field(default_factory=list)
    seconds: float = 0.0


# ----------------------------------------------------------------------------------------------- tensor helpers


def _search_scheme(scheme: QuantScheme) -> QuantScheme:
    return dataclasses.replace(scheme, mse_clip=False) if scheme.mse_clip else scheme


def _grouped(w: torch.Tensor, group_len: int) -> torch.Tensor:
    """``w`` [..., K] -> [..., G, group_len], the last group zero-padded (zeros never change a group's range)."""
    k = w.shape[-1]
    groups = -(-k // group_len)
    pad = groups * group_len - k
    if pad:
        w = F.pad(w, (0, pad))
    return w.reshape(*w.shape[:-1], groups, group_len)


def _ungrouped(w: torch.Tensor, k: int) -> torch.Tensor:
    return w.reshape(*w.shape[:-2], -1)[..., :k]


def _fake_quantize_rows_(
    rows: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype, lo_hi: QRange | None = None
) -> torch.Tensor:
    """In place: fake-quantize each row of float32 ``rows`` [R, L] as one group. ``lo_hi``: the rows' known
    (min, max) [R, 1] (e.g. after clamping). Bit-identical to ``fake_quantize(w, *compute_qparams(w))`` with fewer
    passes over memory: one range pass, then in-place arithmetic."""
    lo, hi = torch.aminmax(rows, dim=1, keepdim=True) if lo_hi is None else lo_hi
    scale, zero = compute_qparams(torch.cat([lo, hi], dim=1), scheme, scale_dtype=scale_dtype)
    q = rows.div_(scale).round_()
    if zero is None:
        return q.clamp_(scheme.qmin, scheme.qmax).mul_(scale)
    z = zero.float()
    return q.add_(z).clamp_(scheme.qmin, scheme.qmax).sub_(z).mul_(scale)


def _padded(w: torch.Tensor, padded_len: int) -> torch.Tensor:
    """A fresh float32 copy of ``w`` [N, K] with zero columns up to ``padded_len``."""
    out = torch.zeros(w.shape[0], padded_len, dtype=torch.float32, device=w.device)
    out[:, : w.shape[1]] = w
    return out


def fake_quantize_weight(
    weight: torch.Tensor, scheme: QuantScheme, *, scale_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """float32 dequantized RTN of ``weight`` [N, K], all groups at once (same values as ``quantize_rtn``)."""
    k = weight.shape[1]
    gl = scheme.group_len(k)
    buf = _padded(weight.detach(), scheme.num_groups(k) * gl)
    _fake_quantize_rows_(buf.view(-1, gl), scheme, scale_dtype)
    return buf[:, :k]


@dataclass(slots=True)
class _SearchLinear:
    """One linear of a scaling group, zero-padded to whole groups once, so candidates need no padding pass."""

    weight: torch.Tensor  # float32 [N, K_padded]
    scheme: QuantScheme | None  # None: not quantized
    in_features: int

    @classmethod
    def of(cls, w: torch.Tensor, scheme: QuantScheme | None) -> _SearchLinear:
        k = w.shape[1]
        if scheme is None:
            return cls(w.detach().float(), None, k)
        scheme = _search_scheme(scheme)
        return cls(_padded(w.detach(), scheme.num_groups(k) * scheme.group_len(k)), scheme, k)

    def candidate(self, scales: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
        """``Q(W * s) / s`` [N, K] (``W`` itself when unquantized)."""
        if self.scheme is None:
            return self.weight
        s = F.pad(scales, (0, self.weight.shape[1] - self.in_features), value=1.0)
        buf = self.weight * s
        _fake_quantize_rows_(buf.view(-1, self.scheme.group_len(self.in_features)), self.scheme, scale_dtype)
        return buf.div_(s)[:, : self.in_features]


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1, x.shape[-1]).float()


def _strided_tokens(rows: torch.Tensor, limit: int) -> torch.Tensor:
    step = max(1, -(-rows.shape[0] // limit))
    return rows[::step]


def weight_mean(weights: Sequence[torch.Tensor], schemes: Sequence[QuantScheme | None]) -> torch.Tensor:
    """float32 [K]: per input channel, the mean over all rows of ``|W|`` normalised by its group's abs max."""
    normalised = []
    for w, scheme in zip(weights, schemes, strict=True):
        k = w.shape[1]
        gl = scheme.group_len(k) if scheme is not None else k
        grouped = _grouped(w.detach().float().abs(), gl)
        grouped = grouped / grouped.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        normalised.append(_ungrouped(grouped, k))
    return torch.cat(normalised).mean(dim=0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, ratio: float) -> torch.Tensor:
    """``x_mean**r / w_mean**(1-r)`` (``w_mean`` None: no duo scaling), >= 1e-4, normalised by sqrt(max*min)."""
    s = x_mean.float().pow(ratio)
    if w_mean is not None:
        s = s / w_mean.float().pow(1.0 - ratio).clamp_min(1e-4)
    s = s.clamp_min(1e-4)
    return s / (s.max() * s.min()).sqrt()


# ------------------------------------------------------------------------------------------------- scale search


def gram_loss(weights: Sequence[torch.Tensor], gram: torch.Tensor, count: int) -> LossFn:
    """Mean squared output error of linears sharing the input whose Gram matrix is ``gram`` = X^T X (``count`` rows)."""
    originals = [w.detach().float() for w in weights]
    denom = float(count * sum(w.shape[0] for w in originals))

    def loss(candidates: Sequence[torch.Tensor]) -> float:
        total = 0.0
        for w, c in zip(originals, candidates, strict=True):
            delta = c - w
            total += float(((delta @ gram) * delta).sum())
        return total / denom

    return loss


def awq_scale_search(
    weights: Sequence[torch.Tensor],
    schemes: Sequence[QuantScheme | None],
    x_mean: torch.Tensor,
    loss_fn: LossFn,
    config: AWQConfig,
    *,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> ScaleSearchResult:
    """Grid search of the per-input-channel scales of one scaling group (pure: ``weights`` are not modified).

    ``weights``: the group's linear weights [N_i, K] (scheme None: left unquantized); ``x_mean`` [K]: mean |x| of the
    group input; ``loss_fn`` scores the candidate dequantized weights ``Q(W * s) / s``. RTN (s = 1) is scored first
    and only a strictly lower error replaces it.
    """
    linears = [_SearchLinear.of(w, scheme) for w, scheme in zip(weights, schemes, strict=True)]
    ones = torch.ones(linears[0].in_features)
    rtn_error = loss_fn([lin.candidate(ones, scale_dtype) for lin in linears])
    w_mean = weight_mean(weights, schemes) if config.duo_scaling else None
    best = ScaleSearchResult(scales=ones, ratio=None, rtn_error=rtn_error, error=rtn_error)
    for i in range(config.grid):
        ratio = i / config.grid
        scales = candidate_scales(x_mean, w_mean, ratio)
        error = loss_fn([lin.candidate(scales, scale_dtype) for lin in linears])
        best.errors.append((ratio, error))
        if error < best.error:
            best.scales, best.ratio, best.error = scales, ratio, error
    return best


def fold_scales(prev_module: nn.Module, linears: Sequence[nn.Linear], scales: torch.Tensor) -> None:
    """In place: ``prev``'s output channels divided by ``scales`` and the linears' input columns multiplied by them.

    ``prev`` is a norm with an elementwise ``weight`` [K] (and optional ``bias``) or a Linear with K outputs.
    """
    k = scales.numel()
    s = scales.detach().float()
    with torch.no_grad():
        if isinstance(prev_module, nn.Linear):
            if prev_module.out_features != k:
                raise QuantkitError(f"cannot fold {k} scales into a Linear with {prev_module.out_features} outputs")
            prev_module.weight.copy_(prev_module.weight.float() / s[:, None])
        else:
            weight = getattr(prev_module, "weight", None)
            if weight is None or weight.shape != (k,):
                raise QuantkitError(
                    f"cannot fold {k} scales into {type(prev_module).__name__}: no weight of shape [{k}]"
                )
            weight.copy_(weight.float() / s)
        bias = getattr(prev_module, "bias", None)
        if bias is not None:
            bias.copy_(bias.float() / s)
        for linear in linears:
            if linear.in_features != k:
                raise QuantkitError(f"cannot fold {k} scales into a Linear with {linear.in_features} inputs")
            linear.weight.copy_(linear.weight.float() * s[None, :])


# -------------------------------------------------------------------------------------------------- clip search


def clip_shrinks(config: AWQConfig) -> torch.Tensor:
    """Candidate fractions of the abs max: 1.0, 1 - 1/clip_grid, ... down to ``max_shrink`` (inclusive)."""
    steps = [1.0 - i / config.clip_grid for i in range(config.clip_grid + 1)]
    return torch.tensor([f for f in steps if f >= config.max_shrink - 1e-9])


def _clip_errors(
    w: torch.Tensor, gram: torch.Tensor, shrinks: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype
) -> torch.Tensor:
    """[S, N, G]: ``dW_g G_g dW_g^T`` per shrink factor, row and group, for ``w`` grouped as [G, N, L].

    Layout [G, S, N, L] so that the Gram products are one batched matmul over groups without permuted copies."""
    g, gl = w.shape[0], w.shape[2]
    lo, hi = torch.aminmax(w, dim=-1)  # [G, N]
    bound = torch.maximum(-lo, hi)[:, None] * shrinks[None, :, None]  # [G, S, N]
    lo_c = torch.maximum(lo[:, None], -bound)[..., None]
    hi_c = torch.minimum(hi[:, None], bound)[..., None]
    delta = torch.clamp(w[:, None], lo_c, hi_c)  # [G, S, N, L], fresh
    _fake_quantize_rows_(delta.view(-1, gl), scheme, scale_dtype, (lo_c.reshape(-1, 1), hi_c.reshape(-1, 1)))
    delta.sub_(w[:, None])  # error against the unclipped float weight
    weighted = torch.bmm(delta.view(g, -1, gl), gram).view_as(delta)
    return weighted.mul_(delta).sum(dim=-1).permute(1, 2, 0)


def awq_clip_search(
    weight: torch.Tensor,
    x: torch.Tensor,
    scheme: QuantScheme,
    config: AWQConfig,
    *,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> ClipResult:
    """Per row and group, the clamp bound (shrink of the abs max) minimising the group's output error (pure).

    ``x`` [..., K]: the linear's inputs (at most ``config.clip_tokens`` evenly strided tokens are used). Shrink 1.0
    (no clipping) is tried first and only a strictly lower error replaces it.
    """
    scheme = _search_scheme(scheme)
    w = weight.detach().float()
    n, k = w.shape
    gl = scheme.group_len(k)
    rows = _strided_tokens(_token_rows(x), config.clip_tokens)
    xg = _grouped(rows, gl).transpose(0, 1)  # [G, T, L]
    gram = torch.bmm(xg.transpose(1, 2), xg)  # [G, L, L]: block-diagonal part of X^T X
    wg = _grouped(w, gl)  # [N, G, L]
    wg_t = wg.transpose(0, 1).contiguous()  # [G, N, L]
    shrinks = clip_shrinks(config)
    row_chunk = max(1, _CHUNK_ELEMENTS // (len(shrinks) * wg[0].numel()))
    best_err, best_idx, base_err = [], [], []
    for start in range(0, n, row_chunk):
        errors = _clip_errors(wg_t[:, start : start + row_chunk], gram, shrinks, scheme, scale_dtype)
        err, idx = errors.min(dim=0)  # first minimum: ties keep the larger bound (1.0 first)
        best_err.append(err)
        best_idx.append(idx)
        base_err.append(errors[0])
    shrink = shrinks[torch.cat(best_idx)]
    denom = float(rows.shape[0] * n)
    return ClipResult(
        max_val=wg.abs().amax(dim=-1) * shrink,
        shrink=shrink,
        error_before=float(torch.cat(base_err).sum()) / denom,
        error_after=float(torch.cat(best_err).sum()) / denom,
    )


def clip_weight(weight: torch.Tensor, max_val: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """float32 ``weight`` [N, K] clamped per row and group to ``[-max_val, max_val]`` (``max_val`` [N, G])."""
    k = weight.shape[1]
    wg = _grouped(weight.detach().float(), scheme.group_len(k))
    bound = max_val[..., None]
    return _ungrouped(torch.minimum(torch.maximum(wg, -bound), bound), k)


# ------------------------------------------------------------------------------------------------ block driver


@dataclass(slots=True)
class _Call:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(slots=True)
class _Captured:
    """Calibration inputs of one block: each stage's shared linear input, and calls of the inspected modules."""

    stage_inputs: dict[str, list[torch.Tensor]]  # first linear of a stage -> input batches
    calls: dict[str, list[_Call]]  # inspected module path -> its calls

    def rows(self, stage_head: str) -> torch.Tensor:
        return torch.cat([_token_rows(t) for t in self.stage_inputs[stage_head]])


def _output_width(module: nn.Module) -> int | None:
    if isinstance(module, nn.Linear):
        return module.out_features
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if weight is not None and weight.ndim == 1 else None


def applicable_groups(block: nn.Module, arch: ArchSpec) -> tuple[list[ScalingGroup], list[ScalingGroup]]:
    """(groups whose shapes allow folding, skipped groups): e.g. v_proj -> o_proj is skipped under GQA."""
    ok, skipped = [], []
    for group in arch.awq_groups:
        width = _output_width(get_module(block, group.prev))
        fits = width is not None and all(get_module(block, name).in_features == width for name in group.linears)
        (ok if fits else skipped).append(group)
    return ok, skipped


def _inspected_module(group: ScalingGroup, earlier_balanced: set[str], objective: Objective) -> str:
    """The linears' common parent for a multi-linear group under the module objective, else "" (Gram-based)."""
    if objective != "module" or len(group.linears) < 2:
        return ""
    parts = [name.split(".")[:-1] for name in group.linears]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    parent = ".".join(common)
    # The module is re-run on inputs captured before any folding: it must not contain an earlier group's linears.
    if not parent or any(name.startswith(parent + ".") for name in earlier_balanced):
        return ""
    return parent


def _stage_head(arch: ArchSpec, linear: str) -> str:
    for stage in arch.sequential_stages:
        if linear in stage:
            return stage[0]
    raise QuantkitError(f"linear {linear!r} is in no sequential stage of the {arch.family} architecture")


def _capture(
    block: nn.Module, hidden: torch.Tensor, runner: BlockRunner, heads: list[str], inspected: list[str]
) -> _Captured:
    """One float pass of ``block`` over ``hidden`` recording the stage inputs and the inspected modules' calls."""
    captured = _Captured({h: [] for h in heads}, {m: [] for m in inspected})
    handles = []
    for head in heads:

        def grab(_module: nn.Module, args: tuple[Any, ...], head: str = head) -> None:
            captured.stage_inputs[head].append(args[0].detach())

        handles.append(get_module(block, head).register_forward_pre_hook(grab))
    for path in inspected:

        def grab_call(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], path: str = path) -> None:
            captured.calls[path].append(_Call(args, dict(kwargs)))

        handles.append(get_module(block, path).register_forward_pre_hook(grab_call, with_kwargs=True))
    try:
        for start in range(0, hidden.shape[0], runner.batch_size):
            runner(block, hidden[start : start + runner.batch_size])
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _first_output(out: Any) -> torch.Tensor:
    return (out[0] if isinstance(out, tuple) else out).float()


def module_loss(module: nn.Module, linears: Sequence[nn.Linear], calls: Sequence[_Call]) -> LossFn:
    """MSE of ``module``'s output on ``calls`` when ``linears`` hold the candidate weights (restored afterwards)."""
    originals = [lin.weight.detach().clone() for lin in linears]
    reference = [_first_output(module(*c.args, **c.kwargs)) for c in calls]
    numel = sum(r.numel() for r in reference)

    def loss(candidates: Sequence[torch.Tensor]) -> float:
        try:
            for lin, cand in zip(linears, candidates, strict=True):
                lin.weight.copy_(cand)
            total = 0.0
            for call, ref in zip(calls, reference, strict=True):
                total += float((_first_output(module(*call.args, **call.kwargs)) - ref).square().sum())
        finally:
            for lin, orig in zip(linears, originals, strict=True):
                lin.weight.copy_(orig)
        return total / numel

    return loss


def _group_loss(block: nn.Module, group: ScalingGroup, inspected: str, x: torch.Tensor, captured: _Captured) -> LossFn:
    linears = [get_module(block, name) for name in group.linears]
    if inspected:
        return module_loss(get_module(block, inspected), linears, captured.calls[inspected])
    return gram_loss([lin.weight for lin in linears], x.T @ x, x.shape[0])


@torch.no_grad()
def apply_awq_to_block(
    block: nn.Module,
    arch: ArchSpec,
    hidden: torch.Tensor,
    runner: BlockRunner,
    schemes: Mapping[str, QuantScheme],
    config: AWQConfig,
    *,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> AWQBlockReport:
    """AWQ on one decoder block, in place: scales folded into norms / previous linears / balanced linears, then
    (``config.clip``) weights clamped. ``hidden`` [n, T, H]: the block's float calibration input; ``schemes``: the
    scheme of each linear (path relative to the block; a linear without one is left unquantized and unclipped).
    """
    t0 = time.perf_counter()
    report = AWQBlockReport()
    if config.search_samples is not None:
        hidden = hidden[: config.search_samples]
    groups, report.skipped = applicable_groups(block, arch)
    balanced: set[str] = set()
    inspected: dict[ScalingGroup, str] = {}
    for group in groups:
        inspected[group] = _inspected_module(group, balanced, config.objective)
        balanced.update(group.linears)
    heads = sorted({_stage_head(arch, name) for name in arch.linears})
    captured = _capture(block, hidden, runner, heads, sorted({m for m in inspected.values() if m}))
    group_scales: dict[str, torch.Tensor] = {}  # balanced linear -> the scales its input was divided by

    for group in groups:
        x = captured.rows(_stage_head(arch, group.linears[0]))
        stat = ActStat.zeros(x.shape[1])
        stat.update(x)
        linears = [get_module(block, name) for name in group.linears]
        loss_fn = _group_loss(block, group, inspected[group], x, captured)
        result = awq_scale_search(
            [lin.weight for lin in linears],
            [schemes.get(name) for name in group.linears],
            stat.mean(),
            loss_fn,
            config,
            scale_dtype=scale_dtype,
        )
        if result.ratio is not None:
            fold_scales(get_module(block, group.prev), linears, result.scales)
            group_scales.update(dict.fromkeys(group.linears, result.scales))
        report.groups.append(
            GroupReport(group.prev, group.linears, result.ratio, result.rtn_error, result.error, inspected[group])
        )

    if config.clip:
        for name in arch.linears:
            if name.rsplit(".", 1)[-1] in _NO_CLIP or name not in schemes:
                continue
            x = captured.rows(_stage_head(arch, name))
            if name in group_scales:
                x = x / group_scales[name]
            linear = get_module(block, name)
            clip = awq_clip_search(linear.weight, x, schemes[name], config, scale_dtype=scale_dtype)
            linear.weight.copy_(clip_weight(linear.weight, clip.max_val, schemes[name]))
            report.clips.append(ClipReport(name, clip.mean_shrink, clip.error_before, clip.error_after))
    report.seconds = time.perf_counter() - t0
    return report
