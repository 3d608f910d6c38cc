"""Quantize with a recipe's quantization section on a given calibration file, and do nothing else: no calibration,
evaluation, gates or report. bench_recipe_speed runs this in a subprocess, so a recipe's quantize time is measured
as a peer's (interpreter start, imports, model load, calibration pass, save), on the peer's own windows.

    python -m benchmarks.recipe_quantize_worker recipes/best-at-w4-size.yaml --calib C.safetensors --output DIR
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--calib", type=Path, required=True, help="a `quantkit calibrate` file")
    parser.add_argument("--output", type=Path, required=True, help="checkpoint directory (replaced)")
    parser.add_argument("--set", action="append", default=[], help="override a recipe key, as `quantkit run --set`")
    parser.add_argument("--summary", type=Path, default=None, help="write the run's seconds and size as JSON")
    args = parser.parse_args()

    from quantkit.quantization.pipeline import quantize_model
    from quantkit.recipes.quantize_stages import quantize_config
    from quantkit.recipes.schema import load_recipe
    from quantkit.recipes.stages import RecipeRun

    recipe = load_recipe(args.recipe, args.set)
    if recipe.quantization.mixed is not None:
        parser.error(f"{args.recipe}: a mixed-precision recipe plans before it quantizes; time it with `quantkit run`")
    plan = None if recipe.quantization.plan is None else Path(recipe.quantization.plan)  # a shipped plan file
    start = time.perf_counter()
    config = quantize_config(RecipeRun(recipe, None, show_progress=False), args.calib, plan)
    result = quantize_model(recipe.model, config, args.output)
    if args.summary is not None:
        summary = {"seconds": time.perf_counter() - start, "peak_rss_mb": result.peak_rss_mb}
        args.summary.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
