"""A new weight solver is one module (tests/helpers/example_solver.py) and its registration: with nothing else
edited, the CLI offers it as a method with its option, a recipe takes it, the run log and the fingerprint carry its
options, and its checkpoint loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import REPO
from safetensors.torch import load_file

from quantkit.format.loader import load_quantized_model

# the solver's module is imported before the CLI is built, as the package's own algorithm modules are
CLI = "import sys, helpers.example_solver; from quantkit.cli import main; sys.argv[0] = 'quantkit'; main()"


def _quantkit(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}{os.pathsep}{REPO}", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", CLI, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_a_registered_solver_is_a_method_with_its_options(tiny_model_dir: Path, tmp_path: Path) -> None:
    help_text = _quantkit("quantize", "--help").stdout
    assert "--clip-rtn-shrink" in help_text and "clip_rtn" in help_text and "awq+clip_rtn" in help_text

    out = tmp_path / "clipped"
    args = ["quantize", str(tiny_model_dir), "-o", str(out), "--group-size", "32", "--bits", "4"]
    done = _quantkit(*args, "--method", "clip_rtn", "--clip-rtn-shrink", "0.8")
    assert done.returncode == 0, done.stderr
    log = json.loads((out / "quantkit_log.json").read_text())
    assert log["method"] == "clip_rtn" and log["solvers"] == {"clip_rtn": {"shrink": 0.8}}

    source = load_file(str(tiny_model_dir / "model.safetensors"))
    loaded = load_quantized_model(out)
    name = "model.layers.0.mlp.up_proj"
    w = source[f"{name}.weight"].float()
    w_hat = loaded.get_submodule(name).dense_weight()
    # symmetric int4 spans 8 steps below zero: the largest magnitude is 8/7.5 of the shrunk range
    assert float(w_hat.abs().max()) <= 0.8 * 8 / 7.5 * float(w.abs().max()) * 1.01
    assert float((w_hat - w).abs().mean()) < 0.2 * float(w.abs().mean())  # still the weights, rounded

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model: {tiny_model_dir}\noutput: {{directory: {tmp_path / 'r'}}}\n"
        "quantization:\n  solvers: {clip_rtn: {shrink: 0.7}}\n"
    )
    checked = _quantkit("recipe", "validate", str(recipe))
    assert checked.returncode == 0, checked.stderr
    assert "clip_rtn:\n      shrink: 0.7" in checked.stdout
    bad = _quantkit("recipe", "validate", str(recipe), "--set", "quantization.solvers.clip_rtn.shrink=2")
    assert bad.returncode == 2 and "clip_rtn shrink must be in (0, 1], got 2" in bad.stderr
