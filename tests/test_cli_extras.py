"""Extras that match the commands: a command whose extra is missing prints one line naming the pip command and
exits 2 (no traceback); a recipe checks its stages' extras before its first stage; the runtime runs on CPU without
triton; pyproject's extras are the ones quantkit/extras.py names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from helpers.cli import run_cli

from quantkit.extras import EXTRAS, MissingExtraError, extra_for_module, install_command, missing_extra_error, require

REPO = Path(__file__).resolve().parents[1]
INPUT_ERROR = 2


@pytest.fixture
def uninstall(monkeypatch):
    """``uninstall("uvicorn", ...)``: those modules fail to import, as if not installed, until the test ends
    (the quantkit.server modules that imported them are dropped, to be imported again)."""

    def block(*modules: str) -> None:
        for name in list(sys.modules):
            if name.partition(".")[0] in modules or (
                name.startswith("quantkit.server.") and name != "quantkit.server.config"
            ):
                monkeypatch.delitem(sys.modules, name)
        for module in modules:
            monkeypatch.setitem(sys.modules, module, None)

    return block


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_each_extra_names_its_install_command():
    assert install_command("serve") == "pip install 'quantkit[serve]'"
    assert [extra_for_module(m) for m in ("uvicorn", "fastapi.responses", "matplotlib.figure", "triton.language")] == [
        "serve",
        "serve",
        "plot",
        "gpu",
    ]
    assert extra_for_module("numpy") is None and extra_for_module(None) is None
    other = missing_extra_error(ModuleNotFoundError("No module named 'numpy'", name="numpy"))
    assert other is None  # not an optional module: the CLI lets that traceback through


def test_pyproject_extras_provide_the_modules_extras_py_names():
    """serve is FastAPI + uvicorn (+ httpx for smoke), no triton; triton only in gpu; every extra of the table is
    in pyproject (distribution names equal the import names here; starlette comes with fastapi)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def names(extra: str) -> set[str]:
        return {req.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip() for req in extras[extra]}

    assert names("serve") == {"fastapi", "uvicorn", "httpx"}
    assert names("gpu") == {"triton"} and names("plot") == {"matplotlib"}
    assert all("triton" not in names(extra) for extra in extras if extra != "gpu")
    for extra, modules in EXTRAS.items():
        assert set(modules) - {"starlette"} <= names(extra), extra
    assert {"pytest", "ruff", "httpx", "rdata", "psutil", "openai"} <= names("dev")


def test_serve_without_uvicorn_is_one_line_and_exit_2(uninstall, capsys, tmp_path):
    uninstall("uvicorn")
    code, _, err = run_cli(["serve", str(tmp_path / "no-model")], capsys)
    assert code == INPUT_ERROR
    line = _one_error_line(err)
    assert line == (
        "error: quantkit serve needs the 'serve' extra (uvicorn is not installed); install it with: "
        "pip install 'quantkit[serve]'"
    )


def test_smoke_without_the_serve_extra_is_one_line_and_exit_2(uninstall, capsys, tmp_path):
    uninstall("fastapi", "starlette", "uvicorn", "httpx")
    code, _, err = run_cli(["smoke", str(tmp_path / "no-model")], capsys)
    assert code == INPUT_ERROR
    line = _one_error_line(err)
    assert (
        line.startswith("error: quantkit smoke needs the 'serve' extra (") and "pip install 'quantkit[serve]'" in line
    )


def test_a_missing_optional_module_anywhere_becomes_the_extra_line(monkeypatch, capsys, tmp_path):
    """Any command that reaches an optional import (here inspect, made to import matplotlib) gets the same line."""
    from quantkit.format import inspect as inspect_module

    def needs_matplotlib(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setattr(inspect_module, "inspect_checkpoint", needs_matplotlib)
    code, _, err = run_cli(["inspect", str(tmp_path)], capsys)
    assert code == INPUT_ERROR
    assert _one_error_line(err) == (
        "error: quantkit inspect needs the 'plot' extra (matplotlib is not installed); install it with: "
        "pip install 'quantkit[plot]'"
    )


def test_require_names_the_missing_module_and_the_alternative(uninstall):
    uninstall("uvicorn")
    with pytest.raises(MissingExtraError) as info:
        require("serve", "the smoke stage", otherwise="turn it off")
    assert str(info.value) == (
        "the smoke stage needs the 'serve' extra (uvicorn is not installed); install it with: "
        "pip install 'quantkit[serve]', or turn it off"
    )
    assert info.value.extra == "serve" and info.value.module == "uvicorn"
    require("plot")  # installed here: no error


def test_a_recipe_with_smoke_fails_before_its_first_stage_without_the_serve_extra(
    uninstall, tiny_model_dir, text_corpus, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"""\
model: {tiny_model_dir}
calibration: {{dataset: {text_corpus}, num_samples: 8, seq_len: 32}}
quantization: {{solvers: [rtn], scheme: {{bits: 4, group_size: 32}}}}
output: {{directory: {tmp_path / "ckpt"}, force: true}}
evaluation: {{dataset: {text_corpus}, seq_len: 32, windows: 2}}
gates: {{max_ppl_increase_pct: 1000}}
smoke: {{enabled: true}}
"""
    )
    uninstall("uvicorn")
    code, out, err = run_cli(["run", str(recipe), "--report", str(tmp_path / "report")], capsys)
    assert code == INPUT_ERROR
    assert _one_error_line(err) == (
        "error: the recipe's smoke stage (smoke.enabled: true) needs the 'serve' extra (uvicorn is not installed); "
        "install it with: pip install 'quantkit[serve]', or set smoke.enabled: false"
    )
    assert "✓" not in out and not (tmp_path / "cache").exists() and not (tmp_path / "ckpt").exists()  # no stage ran


def test_the_triton_backend_names_the_gpu_extra_where_it_cannot_run(monkeypatch):
    import torch

    from quantkit.errors import QuantkitError
    from quantkit.runtime.attention_backend import select_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(QuantkitError, match=r"needs triton \(the 'gpu' extra: pip install 'quantkit\[gpu\]'\)"):
        select_backend("triton", torch.device("cpu"))
    assert select_backend("auto", torch.device("cpu")).name == "torch"


_GENERATE_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # as if triton were not installed
from quantkit.runtime.kernels.backend import triton_available
from quantkit import LLM, SamplingParams
assert not triton_available()
llm = LLM(sys.argv[1], max_model_len=64)
outs = llm.generate(["the cat", "a dog"], SamplingParams(max_tokens=4, temperature=0))
print("generated" if all(1 <= len(o.token_ids) <= 4 and o.error is None for o in outs) else outs)
"""


@pytest.mark.slow
def test_the_runtime_generates_on_cpu_without_triton(tiny_model_dir):
    done = subprocess.run(
        [sys.executable, "-c", _GENERATE_WITHOUT_TRITON, str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "generated"


def test_the_runtime_on_cpu_loads_no_triton_kernel(tiny_model_dir, monkeypatch):
    """On CPU the engine runs its torch backend: no module of quantkit's Triton kernels (which import triton) is
    loaded. (torch itself may import an installed triton for dynamo; that is torch's business.)"""
    from quantkit import LLM, SamplingParams

    def kernel_modules() -> list[str]:
        return [m for m in sys.modules if m.startswith("quantkit.runtime.kernels.") and not m.endswith(".backend")]

    for name in kernel_modules():
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    llm = LLM(tiny_model_dir, max_model_len=64)
    outs = llm.generate(["the cat"], SamplingParams(max_tokens=2, temperature=0))
    assert len(outs[0].token_ids) >= 1 and outs[0].error is None
    assert kernel_modules() == []
