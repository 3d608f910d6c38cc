"""The package's layering, checked over every import (module-level and lazy, inside functions), so that a wrong
arrow fails CI: ``format/`` knows no algorithm and stands under both the quantizer and the runtime; the algorithms
(``quantization/methods/`` and the pure math in ``quantization/solvers/``) import the foundation, ``format`` and
``model`` (plus the rotation math and the statistics they read), never the block loop; the block loop
(``quantization/``) reaches the algorithms through the registry only and names none of them; ``runtime/`` and
``server/`` load no solver; ``data/`` and ``eval/`` load no solver; ``quantization/`` never reads plan files.
docs/internals.md states the same rules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "quantkit"
# the root (for __version__) and what imports nothing (extras: which optional extra provides which module)
FOUNDATION = {"quantkit", "errors", "progress", "atomic", "faults", "memory", "extras", "device", "redaction"}

# area -> the areas it may import, besides itself and the foundation
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "progress": set(),
    "atomic": set(),
    "faults": set(),
    "memory": set(),
    "device": set(),  # the --device rule: imports torch and errors only
    "redaction": set(),
    "extras": set(),
    "schemas": set(),
    "format": set(),
    "model": {"format"},
    "data": {"model"},
    "eval": {"data", "model", "format"},
    "quantization.solvers": {"format"},  # pure functions: weights (+ statistics) in, integers out; no file I/O
    "quantization.statistics": set(),  # sums and counts of calibration activations
    # one module per algorithm: its config, capabilities and hooks, programmed against the hooks' views
    "quantization.methods": {"quantization.solvers", "quantization.statistics", "format", "model", "rotation"},
    "rotation": {"model"},
    # torch.distributed plumbing: ranks, the fixed-order reduction, the solve plan; no algorithm, no file format
    "distributed": set(),
    "quantization": {
        "distributed",
        "quantization.methods",
        "quantization.solvers",
        "quantization.statistics",
        "data",
        "model",
        "format",
    },
    "mixed": {"quantization", "quantization.methods", "quantization.solvers", "quantization.statistics"}
    | {"data", "model", "format", "eval", "schemas"},
    "recipes": {
        "rotation",
        "export",
        "mixed",
        "quantization",
        "quantization.methods",
        "quantization.solvers",
        "data",
        "model",
        "format",
        "eval",
        "schemas",
        "server",
    },
    "export": {"format", "model"},  # converts stored integer codes: no solver, no requantizing
    "runtime": {"format", "model", "rotation"},  # rotation: the fixed rotation of 8-bit keys
    "server": {"runtime", "format", "model"},
    "bench": {"runtime", "format", "model", "data"},  # drives the engine on shipped text; HF baseline via format
}
ANYTHING = {"cli", "__init__", "__main__"}
SUB_AREAS = {
    "quantization.solvers",
    "quantization.methods",
    "quantization.statistics",
}  # the faces of the package: the CLI and the lazy Python API
_MODULE_STRING = re.compile(r"^quantkit(\.[A-Za-z_]\w*)+$")


def area(module: str) -> str:
    """``quantkit.quantization.solvers.gptq`` -> ``quantization.solvers``; ``quantkit.errors`` -> ``errors``."""
    parts = module.split(".")[1:]
    if not parts:
        return "quantkit"
    if parts[0] == "quantization" and len(parts) > 1 and f"quantization.{parts[1]}" in SUB_AREAS:
        return f"quantization.{parts[1]}"
    return parts[0]


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 2:
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path, name: str) -> list[tuple[int, str]]:
    """(line, module) of every quantkit import in ``path``, wherever it is, plus module paths in strings (lazy
    import tables such as ``{"LLM": "quantkit.runtime.llm"}``)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if base == "quantkit"]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_STRING.match(node.value):
            found.append((node.lineno, node.value))
    return [(line, module) for line, module in found if module == "quantkit" or module.startswith("quantkit.")]


def violations(root: Path) -> list[str]:
    """One line per import that crosses the layering the wrong way."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        own = area(name)
        if own in ANYTHING or (path.stem in ANYTHING and name.count(".") == 1):
            continue
        allowed = ALLOWED.get(own)
        if allowed is None:
            problems.append(f"{path.relative_to(root.parent)}: area '{own}' has no import rule; add it to ALLOWED")
            continue
        for line, module in imported_modules(path, name):
            target = area(module)
            if module == "quantkit" or target in FOUNDATION or target == own or target in allowed:
                continue
            if target not in ALLOWED and target not in ANYTHING:  # a submodule of the root, e.g. quantkit.__version__
                continue
            problems.append(f"{path.relative_to(root.parent)}:{line}: {own} must not import {module} ({target})")
    return problems


def test_the_package_follows_its_layering() -> None:
    assert violations(PACKAGE) == []


def test_every_folder_of_the_package_has_a_rule() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders - set(ALLOWED) - ANYTHING == set()


# the block loop may use the registry's own modules, never an algorithm's
REGISTRY_MODULES = {"registry", "composition", "hooks", "records"}


def algorithm_names(root: Path) -> set[str]:
    """The algorithm modules under quantization/methods/ and the config classes they define."""
    names = set()
    for path in (root / "quantization" / "methods").glob("*.py"):
        if path.stem in REGISTRY_MODULES or path.stem == "__init__":
            continue
        names.add(path.stem)
        tree = ast.parse(path.read_text())
        names |= {n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Config")}
    return names


def block_loop_naming_algorithms(root: Path) -> list[str]:
    """Imports of an algorithm module, or mentions of an algorithm config, in the block loop (quantization/*.py)."""
    names = algorithm_names(root)
    configs = {n for n in names if n.endswith("Config")}
    problems = []
    for path in sorted((root / "quantization").glob("*.py")):
        name = module_name(path, root)
        for line, module in imported_modules(path, name):
            parts = module.split(".")
            if parts[:3] == ["quantkit", "quantization", "methods"] and len(parts) > 3 and parts[3] in names:
                problems.append(f"{path.relative_to(root.parent)}:{line}: imports the algorithm {module}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id in configs:
                problems.append(f"{path.relative_to(root.parent)}:{node.lineno}: names {node.id}")
    return problems


def test_the_block_loop_names_no_algorithm() -> None:
    assert algorithm_names(PACKAGE) >= {"gptq", "rtn", "awq", "tune", "GPTQConfig", "TuneConfig"}
    assert block_loop_naming_algorithms(PACKAGE) == []


def test_a_planted_algorithm_in_the_block_loop_is_caught(tmp_path: Path) -> None:
    root = tmp_path / "quantkit"
    for path in PACKAGE.rglob("*.py"):
        target = root / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    planted = root / "quantization" / "quantize_block.py"
    planted.write_text(
        planted.read_text() + "\n\ndef _planted():\n    from quantkit.quantization.methods.gptq import GPTQConfig\n"
        "    return GPTQConfig()\n"
    )
    found = block_loop_naming_algorithms(root)
    assert len(found) == 2 and "imports the algorithm" in found[0] and "names GPTQConfig" in found[1]


@pytest.mark.parametrize(
    ("where", "line", "wrong"),
    [
        ("runtime/engine.py", "from quantkit.quantization.solvers.gptq import gptq_solve", "runtime must not import"),
        ("server/app.py", "import quantkit.mixed.planner", "server must not import"),
        ("quantization/pipeline.py", "from quantkit.mixed.plan_file import load_plan", "quantization must not import"),
        ("format/pack.py", "from quantkit.quantization.solvers.grid import quantize_rtn", "format must not import"),
        ("eval/evaluate.py", "from quantkit.quantization import pipeline", "eval must not import"),
        ("data/sources.py", "from quantkit.quantization.solvers import gptq", "data must not import"),
        (
            "quantization/solvers/gptq.py",
            "from quantkit.model.blocks import get_module",
            "quantization.solvers must not",
        ),
        (
            "quantization/methods/gptq.py",
            "from quantkit.quantization.block_loop import stage_hessians",
            "quantization.methods must not",
        ),
    ],
)
def test_a_planted_wrong_import_fails(tmp_path: Path, where: str, line: str, wrong: str) -> None:
    """A wrong arrow, module level or lazy inside a function, is caught with its file and line."""
    root = tmp_path / "quantkit"
    for path in PACKAGE.rglob("*.py"):
        target = root / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    planted = root / where
    planted.write_text(planted.read_text() + f"\n\ndef _planted() -> None:\n    {line}\n")
    found = violations(root)
    assert len(found) == 1 and wrong in found[0] and found[0].startswith(f"quantkit/{where}:")
