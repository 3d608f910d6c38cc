"""Checks of a job's schemes that need the model, run before any work (no calibration, no output directory): a
float preset every layer can hold (the format fixes its group, so no layout policy may change it; what only vLLM
refuses, such as FP8_BLOCK's merged rows, ``inspect`` reports, as for integer schemes), an FP8 KV cache
only where quantkit's KV observer can hook the attention, and calibration data wherever the job calibrates.
Each failure is one line naming the layer (or the option) and the fix; the CLI exits 2 on it."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

from quantkit.errors import QuantkitError
from quantkit.format.engines import format_fixes_group, layout_fix, layout_problem
from quantkit.format.scheme import QuantScheme

if TYPE_CHECKING:
    from quantkit.quantization.config import QuantizeConfig

DYNAMIC_PRESET = "FP8_DYNAMIC"  # the data-free preset an error about static scales points to


def check_float_layouts(schemes: Mapping[str, QuantScheme | None], in_features: Mapping[str, int]) -> None:
    """Every layer can hold its float scheme: K a multiple of the format's group (NVFP4 16, MX 32, FP8_BLOCK 128,
    FP4 pairs), which compressed-tensors (and so transformers and vLLM) requires."""
    for name, scheme in schemes.items():
        if scheme is None or not format_fixes_group(scheme):
            continue
        problem = layout_problem(scheme, in_features[name])
        if problem:
            raise QuantkitError(f"{name} cannot hold {scheme.name}: {problem}; {layout_fix(scheme)}")


def kv_observer_problem(model_type: str) -> str | None:
    """Why quantkit cannot calibrate an FP8 KV cache for this architecture; None when it can. The observer is an
    attention function registered with transformers' ``AttentionInterface`` (quantkit/model/kv_attention.py): it runs
    only where the model's attention dispatches through ``ALL_ATTENTION_FUNCTIONS`` by ``config._attn_implementation``,
    which the modeling module then imports."""
    try:
        modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return f"transformers has no modeling module for '{model_type}'"
    if not hasattr(modeling, "ALL_ATTENTION_FUNCTIONS"):
        return f"the {model_type} attention does not dispatch through transformers' attention interface"
    return None


def check_kv_cache(config: QuantizeConfig, model_type: str) -> None:
    if config.kv_cache is None:
        return
    problem = kv_observer_problem(model_type)
    if problem:
        raise QuantkitError(
            f"--kv-cache-scheme {config.kv_cache_scheme}: {problem}, so quantkit's KV observer cannot calibrate the "
            "k/v scales; drop --kv-cache-scheme (vLLM can still use --kv-cache-dtype fp8 with unit scales)"
        )


def check_calibration(config: QuantizeConfig) -> None:
    """A job with no calibration data (``calibration=None`` and no calibration file) must not need any: static input
    scales, a KV cache's scales and the algorithms that read activations are calibrated on windows."""
    if config.calibration is not None or config.calibration_file is not None or not config.needs_calibration:
        return
    if config.static_inputs:
        raise QuantkitError(
            "static input scales (FP8, NVFP4's global input scale) are calibrated on calibration windows and this "
            f"job has none; give --calib FILE (calibration_file), or pick a dynamic preset such as {DYNAMIC_PRESET}"
        )
    if config.kv_cache is not None:
        raise QuantkitError(
            f"--kv-cache-scheme {config.kv_cache_scheme} calibrates k/v scales on calibration windows and this job "
            "has none; give --calib FILE (calibration_file), or drop --kv-cache-scheme"
        )
    raise QuantkitError(
        f"{config.method} reads calibration activations and this job has no calibration data; give --calib FILE "
        "(calibration_file), or use the data-free method rtn"
    )
