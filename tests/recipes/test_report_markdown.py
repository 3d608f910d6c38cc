"""report.md: a summary, metrics and gate tables that render on GitHub, and relative links to the plots of the
per-layer measurement and the plan's frontier (skipped, with the extra to install, without matplotlib)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers.tiny import rtn_for_tests

from quantkit.format.quantization_config import build_quantization_config
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import linear_tensors
from quantkit.format.writer import ShardedWriter
from quantkit.mixed.candidates import parse_candidate, unit_storage_bits
from quantkit.mixed.measurement import CandidateCost, Measurement, UnitMeasurement, save_measurement
from quantkit.mixed.plan_file import save_plan
from quantkit.mixed.planner import plan
from quantkit.recipes.report import (
    FRONTIER_PNG,
    PER_LAYER_PNG,
    REPORT_JSON,
    REPORT_MD,
    GateResult,
    RecipeReport,
    StageRecord,
    write_report,
)

PNG = b"\x89PNG\r\n\x1a\n"
CANDIDATES = ["int4-g64", "int4-g32", "int8", "fp16"]
FIGURES = {
    "calibration windows": 8,
    "perplexity": 12.3456789,
    "baseline perplexity": 11.5,
    "perplexity increase %": 7.353,
    "kl mean": 0.0421,
    "kl p99": 0.31,
    "top-1 agreement": 0.8765,
    "eval tokens": 4096,
    "eval windows": 8,
    "checkpoint MB": 0.05,
}


def _checkpoint(path: Path) -> Path:
    """Two layers at w4 g64, one at w8 per-channel (a mixed checkpoint)."""
    g64, w8 = QuantScheme(bits=4, group_size=64), QuantScheme(bits=8, group_size=-1)
    schemes = {
        "model.layers.0.mlp.down_proj": g64,
        "model.layers.1.mlp.down_proj": g64,
        "model.layers.2.mlp.down_proj": w8,
    }
    tensors = {}
    for i, (name, scheme) in enumerate(schemes.items()):
        tensors |= linear_tensors(
            name,
            rtn_for_tests(torch.randn(32, 128, generator=torch.Generator().manual_seed(i)), scheme),
            torch.bfloat16,
        )
    groups = [(s, [n for n, x in schemes.items() if x == s]) for s in (g64, w8)]
    with ShardedWriter(path) as writer:
        writer.add(tensors)
        writer.finalize({}, [], quantization_config=build_quantization_config(groups, []))
    return path


def _measurement_and_plan(root: Path) -> tuple[Path, Path]:
    units = []
    for layer in range(4):
        for name, shapes in (("self_attn.o_proj", [(64, 64)]), ("mlp.down_proj", [(64, 256)])):
            full = f"model.layers.{layer}.{name}"
            scale = 1e-3 * (layer + 1)
            ratios = {"int4-g64": 1.0, "int4-g32": 0.8, "int8": 0.01, "fp16": 0.0}
            options = {
                c: CandidateCost(scale * r, unit_storage_bits(parse_candidate(c), shapes)) for c, r in ratios.items()
            }
            units.append(UnitMeasurement(full, [full], sum(n * k for n, k in shapes), options))
    measurement = Measurement("tiny", "hybrid", CANDIDATES, units)
    m_path = save_measurement(measurement, root / "measurement.json")
    p_path = save_plan(plan(measurement, target_bits=5.0), root / "plan.yaml")
    return m_path, p_path


def _report(tmp_path: Path, artifacts: dict[str, str]) -> RecipeReport:
    return RecipeReport(
        recipe="recipes/mixed.yaml",
        output=str(_checkpoint(tmp_path / "ckpt")),
        report_dir=str(tmp_path / "report"),
        passed=False,
        stages=[StageRecord("calibrate", 0.5, True, "abc"), StageRecord("quantize", 2.25, False, "def", "ckpt | x")],
        gates=[
            GateResult("max_kl_mean", 0.0421, 0.03, "<=", False, -0.0121),
            GateResult("min_top1_agreement", 0.8765, 0.8, ">=", True, 0.0765),
        ],
        figures=dict(FIGURES),
        hashes={"model": "0123456789abcdef0123"},
        environment={"python": "3.11", "argv": "quantkit run a|b"},
        smoke={"ok": True, "failures": [], "requests": 3, "seconds": 1.5},
        config={"model": "tiny-llama", "quantization": {"method": "gptq", "mixed": {"target_bits": 5.0}}},
        artifacts=artifacts,
    )


def _tables(markdown: str) -> list[list[str]]:
    """The Markdown tables (runs of lines starting with '|')."""
    tables, current = [], []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables


def _cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]


def _written(tmp_path: Path, artifacts: dict[str, str]) -> tuple[str, dict]:
    write_report(_report(tmp_path, artifacts), tmp_path / "report")
    return (tmp_path / "report" / REPORT_MD).read_text(), json.loads((tmp_path / "report" / REPORT_JSON).read_text())


def test_report_md_has_summary_metrics_and_gate_tables(tmp_path: Path) -> None:
    m_path, p_path = _measurement_and_plan(tmp_path)
    markdown, data = _written(tmp_path, {"measurement": str(m_path), "plan": str(p_path)})
    assert markdown.startswith("# Recipe report: recipes/mixed.yaml\n\n**FAILED**: failed max_kl_mean\n")
    for table in _tables(markdown):  # GitHub renders a table only when every row has the header's cell count
        assert re.fullmatch(r"\|(---:?\|)+", table[1]), table
        assert {len(_cells(row)) for row in table} == {len(_cells(table[0]))}, table
    rows: dict[str, list[str]] = {}
    for row in (r for t in _tables(markdown) for r in t[2:]):
        rows.setdefault(_cells(row)[0], _cells(row)[1:])  # the first table with that key: the summary's "model"
    assert rows["model"] == ["`tiny-llama`"] and rows["method"] == ["gptq"]
    assert rows["scheme"] == ["mixed (target 5 bits/w): 2 schemes, layers per scheme below"]
    ckpt = data["checkpoint"]
    assert rows["size"][0].startswith(f"{ckpt['bytes'] / 1e6:.3g} MB (bf16 ")
    assert rows["bits per weight"][0].startswith(f"{ckpt['bits_per_weight']:.3f} (quantized Linears)")
    assert rows["time"] == ["2.8 s (cached: calibrate)"]
    assert rows["w4-g64-sym"][:2] == ["2", "8,192"] and rows["w8-ch-sym"][:2] == ["1", "4,096"]
    assert rows["perplexity"] == ["12.3457"] and rows["reference perplexity"] == ["11.5000"]
    assert rows["perplexity increase"] == ["+7.35%"]
    assert rows["KL mean"] == ["0.0421"] and rows["KL p99"] == ["0.31"] and rows["top-1 agreement"] == ["0.8765"]
    assert rows["max_kl_mean"] == ["<= 0.03", "0.0421", "-0.0121", "FAIL"]
    assert rows["min_top1_agreement"] == [">= 0.8", "0.8765", "+0.0765", "PASS"]
    assert rows["ok"] == ["3", "1.5", "-"]  # the smoke test, a table (no Python dict pasted)
    assert rows["quantize"][-2:] == ["ckpt \\| x", "`def`"]  # a pipe in a cell is escaped
    assert "{'" not in markdown and "checkpoint MB" not in markdown  # the size is in the summary
    assert "```yaml\nmodel: tiny-llama\n" in markdown and "<details>" in markdown


def test_report_md_links_the_plots_written_beside_it(tmp_path: Path) -> None:
    m_path, p_path = _measurement_and_plan(tmp_path)
    markdown, data = _written(tmp_path, {"measurement": str(m_path), "plan": str(p_path)})
    links = re.findall(r"!\[[^\]]+\]\(([^)]+)\)", markdown)
    assert links == [PER_LAYER_PNG, FRONTIER_PNG]  # relative: the report directory moves as a whole
    for name in links:
        assert (tmp_path / "report" / name).read_bytes()[:8] == PNG
    assert "![KL per layer (hybrid)](per_layer.png)" in markdown
    assert data["plots"] == {
        "KL per layer (hybrid)": PER_LAYER_PNG,
        "Size/error frontier, uniform schemes marked": FRONTIER_PNG,
    }
    assert data["plots_note"] == "" and data["artifacts"]["measurement"] == str(m_path)


def test_without_matplotlib_the_report_says_plots_were_skipped(tmp_path: Path, monkeypatch) -> None:
    m_path, p_path = _measurement_and_plan(tmp_path)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # an import of any of them now fails
    markdown, data = _written(tmp_path, {"measurement": str(m_path), "plan": str(p_path)})
    assert "Plots skipped: plotting needs matplotlib; install it with `pip install 'quantkit[plot]'`" in markdown
    assert "(the optional 'plot' extra)" in markdown
    assert "![" not in markdown and not list((tmp_path / "report").glob("*.png"))
    assert data["plots"] == {} and "matplotlib" in data["plots_note"]
    assert "| max_kl_mean | <= 0.03 | 0.0421 | -0.0121 | FAIL |" in markdown  # the rest of the report is whole


def test_a_run_without_per_layer_measurements_says_so(tmp_path: Path) -> None:
    markdown, data = _written(tmp_path, {})
    assert "No per-layer plots: this run measured no per-layer sensitivity (quantization.mixed does)." in markdown
    assert data["plots"] == {} and "![" not in markdown


@pytest.mark.slow
def test_a_mixed_recipe_run_links_its_plots(tiny_model_dir, text_corpus, tmp_path, capsys, monkeypatch):
    """The run hands its measurement and plan to the report (mixed recipe: hybrid sensitivity by default)."""
    from helpers.cli import run_cli

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""\
model: {tiny_model_dir}
calibration: {{dataset: {text_corpus}, num_samples: 4, seq_len: 32}}
quantization:
  solvers: [rtn]
  mixed: {{target_bits: 6, candidates: [int4-g32, int8, fp16]}}
output: {{directory: {tmp_path / "ckpt"}, force: true}}
evaluation: {{dataset: {text_corpus}, seq_len: 32, windows: 2}}
gates: {{max_ppl_increase_pct: 1000}}
""")
    code, _, err = run_cli(["run", str(recipe), "--report", str(tmp_path / "report")], capsys)
    assert code == 0, err
    markdown = (tmp_path / "report" / REPORT_MD).read_text()
    assert f"![KL per layer (hybrid)]({PER_LAYER_PNG})" in markdown and f"]({FRONTIER_PNG})" in markdown
    assert (tmp_path / "report" / FRONTIER_PNG).read_bytes()[:8] == PNG
    data = json.loads((tmp_path / "report" / REPORT_JSON).read_text())
    assert set(data["artifacts"]) == {"measurement", "plan"} and data["checkpoint"]["bits_per_weight"] <= 6
    assert "| max_ppl_increase_pct | <= 1000 |" in markdown and "| perplexity |" in markdown
