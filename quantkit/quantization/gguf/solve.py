"""One tensor onto its GGML type: GPTQ on the type's own grid when there is a Hessian, round-to-nearest otherwise,
a plain float16 copy for llama.cpp's F16 fallback. The math is :mod:`quantkit.quantization.solvers.ggml_solve`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from quantkit.quantization.gguf.mixes import F16

RTN, GPTQ = "rtn", "gptq"
METHODS = (RTN, GPTQ)


@dataclass(slots=True)
class SolveSettings:
    method: str = GPTQ
    act_order: bool = False
    gptq: Any = None  # GPTQSettings (damp, block_size, damp_retries, damp_growth)


@dataclass(slots=True)
class SolvedTensor:
    data: np.ndarray  # uint8 [N, row bytes]: what llama.cpp stores, rows in Hugging Face order
    dequantized: torch.Tensor  # float32 [N, K]: what llama.cpp decodes
    loss: float  # the solver's: tr(dW H dW^T) with a Hessian
    damp: float
    fell_back_to_rtn: bool


def _hessian_error(weight: torch.Tensor, dequantized: torch.Tensor, hessian: torch.Tensor | None) -> float:
    delta = (weight.float() - dequantized).double()
    if hessian is None:
        return float(delta.square().sum())
    return float(((delta @ hessian.double()) * delta).sum())


def solve_tensor(
    weight: torch.Tensor, hessian: torch.Tensor | None, type_name: str, settings: SolveSettings, name: str = ""
) -> SolvedTensor:
    """``weight`` [N, K] as ``type_name``: GPTQ when ``settings.method`` is gptq and a Hessian is given."""
    w = weight.detach().float()
    if type_name == F16:
        half = w.to(torch.float16)
        data = half.cpu().numpy().view(np.uint8).reshape(w.shape[0], -1)
        return SolvedTensor(data, half.float(), _hessian_error(w, half.float(), hessian), 0.0, False)
    from quantkit.quantization.solvers.ggml_solve import ggml_gptq, ggml_rtn

    if hessian is None or settings.method == RTN:
        result = ggml_rtn(w, type_name)
        loss = _hessian_error(w, result.dequantized, hessian)
        return SolvedTensor(result.data, result.dequantized, loss, 0.0, False)
    result = ggml_gptq(w, hessian, type_name, settings.gptq, act_order=settings.act_order, name=name)
    return SolvedTensor(result.data, result.dequantized, float(result.loss), result.damp, result.fell_back_to_rtn)
