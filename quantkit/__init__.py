"""quantkit: offline quantization and compression for Hugging Face causal LMs.

The Python face of the command line (names are imported on first use, so ``import quantkit`` stays light)::

    import quantkit

    config = quantkit.QuantizeConfig.for_method("gptq", scheme=quantkit.QuantScheme(bits=4, group_size=64))
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
    "CalibrationConfig",
    "EvalConfig",
    "GPTQConfig",
    "QuantScheme",
    "QuantizeConfig",
    "RTNConfig",
    "RotationConfig",
    "SamplingParams",
    "TuneConfig",
    "evaluate",
    "quantize",
]

if TYPE_CHECKING:
    from quantkit.data.calibration import CalibrationConfig
    from quantkit.eval.evaluate import EvalConfig, evaluate
    from quantkit.format.scheme import QuantScheme
    from quantkit.quantization.config import QuantizeConfig
    from quantkit.quantization.pipeline import quantize_model as quantize
    from quantkit.quantization.solvers.awq import AWQConfig
    from quantkit.quantization.solvers.gptq import GPTQConfig
    from quantkit.quantization.solvers.grid import RTNConfig
    from quantkit.quantization.solvers.tune import TuneConfig
    from quantkit.rotation.config import RotationConfig
    from quantkit.runtime.llm import LLM
    from quantkit.runtime.sampling_params import SamplingParams

# public name -> (module, attribute)
_LAZY: dict[str, tuple[str, str]] = {
    "quantize": ("quantkit.quantization.pipeline", "quantize_model"),
    "QuantizeConfig": ("quantkit.quantization.config", "QuantizeConfig"),
    "QuantScheme": ("quantkit.format.scheme", "QuantScheme"),
    "RTNConfig": ("quantkit.quantization.solvers.grid", "RTNConfig"),
    "GPTQConfig": ("quantkit.quantization.solvers.gptq", "GPTQConfig"),
    "AWQConfig": ("quantkit.quantization.solvers.awq", "AWQConfig"),
    "TuneConfig": ("quantkit.quantization.solvers.tune", "TuneConfig"),
    "RotationConfig": ("quantkit.rotation.config", "RotationConfig"),
    "CalibrationConfig": ("quantkit.data.calibration", "CalibrationConfig"),
    "evaluate": ("quantkit.eval.evaluate", "evaluate"),
    "EvalConfig": ("quantkit.eval.evaluate", "EvalConfig"),
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
