"""A recipe's GGUF outputs (``output.gguf: [Q4_K_M, ...]``): llama.cpp's mixes solved from the float model with
the recipe's solver (GPTQ or round-to-nearest) on the recipe's calibration windows, with the recipe's rotation
folded in when it has one and its float targets when it has them, each written as ``<directory>.<MIX>.gguf``
beside the checkpoint; kept while the checkpoint is unchanged."""

from __future__ import annotations

from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.recipes.stages import RecipeRun


def gguf_path(output: Path, mix: str) -> Path:
    return output.with_name(f"{output.name}.{mix.upper()}.gguf")


def gguf_stages(run: RecipeRun, calib_path: Path, output: Path) -> None:
    from quantkit.export.gguf_typed import write_typed_gguf
    from quantkit.quantization.gguf.driver import GGUFOutputConfig, quantize_to_gguf
    from quantkit.quantization.gguf.solve import GPTQ, RTN, SolveSettings
    from quantkit.quantization.methods.float_targets import FloatTargetsConfig
    from quantkit.quantization.methods.gptq import GPTQConfig
    from quantkit.quantization.methods.rotation import RotationConfig
    from quantkit.quantization.methods.rtn import RTNConfig

    mixes = run.recipe.output.gguf
    if not mixes:
        return
    q = run.recipe.quantization
    configs = q.solver_configs()
    gptq = next((c for c in configs if isinstance(c, GPTQConfig)), None)
    rotation = next((c for c in configs if isinstance(c, RotationConfig)), None)
    # GPTQ with it: the schema checked
    float_targets = next((c for c in configs if isinstance(c, FloatTargetsConfig)), None)
    if any(not isinstance(c, (GPTQConfig, RTNConfig, RotationConfig, FloatTargetsConfig)) for c in configs):
        names = ", ".join(type(c).__name__ for c in configs)
        raise QuantkitError(
            f"output.gguf solves with GPTQ or round-to-nearest (and a rotation, float targets) only; the recipe's "
            f"solvers are {names}"
        )
    settings = SolveSettings(method=GPTQ if gptq else RTN, act_order=q.quant_scheme().act_order, gptq=gptq)
    quantized_again = any(r.name == "quantize" and not r.cached for r in run.stages)
    for mix in mixes:
        path = gguf_path(output, mix)
        with run.stage(f"gguf {mix}") as st:
            st.cached = path.exists() and not quantized_again
            if not st.cached:
                job = GGUFOutputConfig(
                    mix=mix,
                    solve=settings,
                    calibration_file=calib_path,
                    batch_size=q.batch_size,
                    force=True,
                    device=run.recipe.device,
                    show_progress=run.show_progress,
                    rotation=rotation,
                    float_targets=float_targets,
                )
                quantize_to_gguf(run.recipe.model, job, path, write_typed_gguf)
            st.detail = str(path)
        run.figures[f"gguf {mix} MB"] = round(path.stat().st_size / 1e6, 3)
