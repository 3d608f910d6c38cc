"""AWQ's weight clipping (Lin et al., 2023): per output row and quantization group, the weight range is shrunk by
the factor (1.0 down to ``max_shrink``) that minimises the group's output contribution error
``||X_g (W_g - Q(clamp(W_g)))^T||^2``, evaluated exactly through the per-group block-diagonal Gram matrices.
No clipping (1.0) is tried first and only a strictly lower error replaces it. Pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.format.scheme import QuantScheme
from quantkit.quantization.solvers.awq import (
    AWQSettings,
    _fake_quantize_rows_,
    _grouped,
    _search_scheme,
    _strided_tokens,
    _token_rows,
    _ungrouped,
)

_CHUNK_ELEMENTS = 1 << 24  # clip search: floats per vectorised chunk (64 MiB)


@dataclass(slots=True)
class ClipResult:
    max_val: torch.Tensor  # float32 [N, G]: clamp bound per output row and group
    shrink: torch.Tensor  # float32 [N, G]: chosen fraction of the original abs max
    error_before: float  # output MSE summed over groups, per token and output row, without clipping
    error_after: float

    @property
    def mean_shrink(self) -> float:
        return float(self.shrink.mean())


# -------------------------------------------------------------------------------------------------- clip search


def clip_shrinks(config: AWQSettings) -> torch.Tensor:
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
    config: AWQSettings,
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
    shrinks = clip_shrinks(config).to(w.device)
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
