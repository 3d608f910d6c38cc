"""A linear's input quantized and dequantized as the serving kernel computes it, for every input scheme of the
presets (compressed-tensors' ``input_activations``): dynamic per token (vLLM's ``scaled_fp8_quant`` /
``scaled_int8_quant``: one scale per row, ``absmax / max``), static per tensor (the checkpoint's ``input_scale``),
dynamic per group (FP8 in groups of 128 for FP8_BLOCK; the MX formats' power-of-two scales per 32) and NVFP4's
groups of 16 under FP8 scales and the checkpoint's static ``input_global_scale``.

Plain torch on any device; the values are those the kernel multiplies, so a model run with these at every
quantized linear's input measures what a serving engine computes (up to the summation order).
"""

from __future__ import annotations

import torch

from quantkit.format.float_codes import FP4_MAX, FP8_MAX, e8m0_value, mx_scale_exponent, round_fp4
from quantkit.format.scheme import ActivationScheme

# vLLM's dynamic per-token FP8 scale floor (``1 / (448 * 512)``): an all-zero row does not divide by zero
_MIN_FP8_SCALE = 1.0 / (FP8_MAX * 512.0)
_INT8_MAX = 127.0


def _round(x: torch.Tensor, acts: ActivationScheme) -> torch.Tensor:
    """Scaled values rounded to the input's codes (float32)."""
    if acts.type == "int":
        return x.round().clamp(-_INT8_MAX - 1, _INT8_MAX)
    if acts.bits == 8:
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return round_fp4(x.clamp(-FP4_MAX, FP4_MAX))


def _element_max(acts: ActivationScheme) -> float:
    if acts.type == "int":
        return _INT8_MAX
    return FP8_MAX if acts.bits == 8 else FP4_MAX


def _grouped(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] % size:
        raise ValueError(f"input groups of {size} do not divide {x.shape[-1]} features")
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def fake_quantize_input(x: torch.Tensor, acts: ActivationScheme, static_scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` (any leading dims, features last) quantized and dequantized under ``acts``, in ``x``'s dtype.

    ``static_scale``: the checkpoint's ``input_scale`` (a static scheme) or ``input_global_scale`` (NVFP4).
    """
    xf = x.float()
    top = _element_max(acts)
    if acts.dynamic is False:
        if static_scale is None:
            raise ValueError("a static input scheme needs its calibrated input scale")
        scale = static_scale.float().to(x.device)
        return (_round(xf / scale, acts) * scale).to(x.dtype)
    if acts.strategy == "token":
        scale = xf.abs().amax(dim=-1, keepdim=True) / top
        if acts.type == "float":
            scale = scale.clamp(min=_MIN_FP8_SCALE)
        else:
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (_round(xf / scale, acts) * scale).to(x.dtype)
    if acts.strategy == "tensor":
        scale = (xf.abs().amax() / top).clamp(min=_MIN_FP8_SCALE)
        return (_round(xf / scale, acts) * scale).to(x.dtype)
    assert acts.group_size is not None
    groups = _grouped(xf, acts.group_size)
    absmax = groups.abs().amax(dim=-1, keepdim=True)
    if acts.scale_format == "e8m0":
        scale = e8m0_value(mx_scale_exponent(absmax, acts.bits).clamp(0, 254))
    elif acts.scale_format == "fp8":  # NVFP4: FP8 group scales under the static global scale
        if static_scale is None:
            raise ValueError("an NVFP4 input needs its calibrated input global scale")
        g = static_scale.float().to(x.device)
        stored = (absmax / top * g).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()
        scale = torch.where(stored > 0, stored, torch.full_like(stored, 2.0**-6)) / g
    else:
        scale = (absmax / top).clamp(min=_MIN_FP8_SCALE)
    return (_round(groups / scale, acts) * scale).reshape(x.shape).to(x.dtype)


def static_input_scale(absmax: float, acts: ActivationScheme, dtype: torch.dtype) -> torch.Tensor:
    """The static scale a calibrated input range gives (float32 [1], rounded as stored): ``absmax / max`` in the
    checkpoint's scale dtype, or NVFP4's global scale ``448 * 6 / absmax`` (float32)."""
    amax = max(float(absmax), torch.finfo(torch.float32).tiny)
    if acts.dynamic == "local":
        return torch.tensor([FP8_MAX * FP4_MAX / amax], dtype=torch.float32)
    scale = torch.tensor([amax / _element_max(acts)], dtype=torch.float32)
    return scale.to(dtype).float()
