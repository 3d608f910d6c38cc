"""quantkit: offline quantization and compression for Hugging Face causal LMs.

The Python face of the command line (names are imported on first use, so ``import quantkit`` stays light)::

    import quantkit

    config = quantkit.QuantizeConfig.for_method("gptq", scheme=quantkit.QuantScheme(bits=4, group_size=64))
    # algorithms compose as a list, e.g. [RotationConfig(), GPTQConfig(), FloatTargetsConfig(), HeadRefitConfig()]
    result = quantkit.quantize("smollm2-135m", config, "smollm2-w4g64")
    print(quantkit.evaluate("smollm2-w4g64", quantkit.EvalConfig(reference="smollm2-135m", max_windows=20)))
    llm = quantkit.LLM("smollm2-w4g64")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "AWQConfig",
    "BehaviourConfig",
    "CalibrationConfig",
    "EvalConfig",
    "FloatTargetsConfig",
    "GPTQConfig",
    "HeadRefitConfig",
    "QuantScheme",
    "QuantizeConfig",
    "RTNConfig",
    "RotationConfig",
    "SamplingParams",
    "SmoothQuantConfig",
    "TuneConfig",
    "evaluate",
    "quantize",
]

if TYPE_CHECKING:
    from quantkit.data.calibration import CalibrationConfig
    from quantkit.eval.behaviour import BehaviourConfig
    from quantkit.eval.evaluate import EvalConfig, evaluate
    from quantkit.format.scheme import QuantScheme
    from quantkit.quantization.config import QuantizeConfig
    from quantkit.quantization.methods.awq import AWQConfig
    from quantkit.quantization.methods.float_targets import FloatTargetsConfig
    from quantkit.quantization.methods.gptq import GPTQConfig
    from quantkit.quantization.methods.head_refit import HeadRefitConfig
    from quantkit.quantization.methods.rotation import RotationConfig
    from quantkit.quantization.methods.rtn import RTNConfig
    from quantkit.quantization.methods.smoothquant import SmoothQuantConfig
    from quantkit.quantization.methods.tune import TuneConfig
    from quantkit.quantization.pipeline import quantize_model as quantize
    from quantkit.runtime.llm import LLM
    from quantkit.runtime.sampling_params import SamplingParams

# public name -> (module, attribute)
_LAZY: dict[str, tuple[str, str]] = {
    "quantize": ("quantkit.quantization.pipeline", "quantize_model"),
    "QuantizeConfig": ("quantkit.quantization.config", "QuantizeConfig"),
    "QuantScheme": ("quantkit.format.scheme", "QuantScheme"),
    "RTNConfig": ("quantkit.quantization.methods.rtn", "RTNConfig"),
    "GPTQConfig": ("quantkit.quantization.methods.gptq", "GPTQConfig"),
    "AWQConfig": ("quantkit.quantization.methods.awq", "AWQConfig"),
    "SmoothQuantConfig": ("quantkit.quantization.methods.smoothquant", "SmoothQuantConfig"),
    "FloatTargetsConfig": ("quantkit.quantization.methods.float_targets", "FloatTargetsConfig"),
    "TuneConfig": ("quantkit.quantization.methods.tune", "TuneConfig"),
    "RotationConfig": ("quantkit.quantization.methods.rotation", "RotationConfig"),
    "HeadRefitConfig": ("quantkit.quantization.methods.head_refit", "HeadRefitConfig"),
    "CalibrationConfig": ("quantkit.data.calibration", "CalibrationConfig"),
    "evaluate": ("quantkit.eval.evaluate", "evaluate"),
    "EvalConfig": ("quantkit.eval.evaluate", "EvalConfig"),
    "BehaviourConfig": ("quantkit.eval.behaviour", "BehaviourConfig"),  # EvalConfig(behaviour=...)
    "LLM": ("quantkit.runtime.llm", "LLM"),
    "SamplingParams": ("quantkit.runtime.sampling_params", "SamplingParams"),
}


def __getattr__(name: str) -> Any:
    """Import a public name's module only when the name is first used."""
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
