"""The min_quantized_fraction gate (of the block linears' weights, the part the checkpoint stores quantized, read
from its coverage audit) and the max_checkpoint_mb gate (the checkpoint files' size): a run outside either fails,
and the report and the checkpoint's model card carry the audit and the figures."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers.cli import run_cli

from quantkit.format.files import MODEL_CARD
from quantkit.quantization.model_card import EVAL_END, EVAL_START, NOT_EVALUATED
from quantkit.recipes.report import GATES, check_gates
from quantkit.recipes.schema import GatesSection, RecipeError, recipe_from_text

QUALITY = ({"perplexity": 11.0, "kl_mean": 0.01, "top1_agreement": 0.9}, {"perplexity": 10.0})
IGNORED_FRACTION = 1 - 64 * 160 / 86_016  # the tiny model with one of its two down_proj in float


def test_the_gate_passes_at_and_above_its_threshold_and_fails_below() -> None:
    assert "min_quantized_fraction" in GATES
    (gate,) = check_gates(GatesSection(min_quantized_fraction=0.9), *QUALITY, quantized_fraction=IGNORED_FRACTION)
    assert (gate.name, gate.comparison, gate.passed) == ("min_quantized_fraction", ">=", False)
    assert gate.value == pytest.approx(0.880952, abs=1e-6) and gate.margin == pytest.approx(IGNORED_FRACTION - 0.9)
    (gate,) = check_gates(GatesSection(min_quantized_fraction=0.88), *QUALITY, quantized_fraction=IGNORED_FRACTION)
    assert gate.passed and gate.margin == pytest.approx(IGNORED_FRACTION - 0.88)
    (gate,) = check_gates(GatesSection(min_quantized_fraction=1.0), *QUALITY, quantized_fraction=1.0)
    assert gate.passed and gate.margin == 0
    assert check_gates(GatesSection(), *QUALITY, quantized_fraction=0.0) == []  # unset: not checked


def test_the_schema_takes_a_fraction() -> None:
    base = "model: m\noutput: {directory: o}\ngates: {min_quantized_fraction: %s}\n"
    assert recipe_from_text(base % "0.95").gates.min_quantized_fraction == 0.95
    with pytest.raises(RecipeError, match=r"gates\.min_quantized_fraction"):
        recipe_from_text(base % "1.5")


def test_a_run_leaving_a_linear_in_float_fails_the_gate(tiny_model_dir, text_corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""\
model: {tiny_model_dir}
calibration: {{dataset: {text_corpus}, num_samples: 4, seq_len: 32}}
quantization:
  solvers: [rtn]
  scheme: {{bits: 4, group_size: 32}}
  ignore: ['layers\\.1\\.mlp\\.down_proj']
output: {{directory: {tmp_path / "ckpt"}, force: true}}
evaluation: {{dataset: {text_corpus}, seq_len: 32, windows: 2}}
gates: {{min_quantized_fraction: 0.9, max_ppl_increase_pct: 1000, max_checkpoint_mb: 100}}
""")
    code, _, err = run_cli(["run", str(recipe), "--report", str(tmp_path / "report")], capsys)
    assert code == 1, err
    assert "gate failed: min_quantized_fraction: measured 0.880952, threshold >= 0.9" in " ".join(err.split())
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["coverage"]["quantized_fraction"] == pytest.approx(IGNORED_FRACTION)
    assert report["figures"]["quantized fraction"] == round(IGNORED_FRACTION, 6)
    size_mb = sum(f.stat().st_size for f in (tmp_path / "ckpt").glob("*.safetensors")) / 1e6
    assert report["figures"]["checkpoint MB"] == round(size_mb, 3)
    size_gate = next(g for g in report["gates"] if g["name"] == "max_checkpoint_mb")
    assert size_gate["passed"] and size_gate["value"] == pytest.approx(size_mb)
    ignored = next(w for w in report["coverage"]["weights"] if w["name"] == "model.layers.1.mlp.down_proj")
    assert (ignored["intended"], ignored["actual"], ignored["float_by"]) == ("float", "float", "ignore")
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "## Coverage" in markdown and "| dense MLP | 6 |" in markdown and "kept in float by --ignore" in markdown

    card = (tmp_path / "ckpt" / MODEL_CARD).read_text()
    assert yaml.safe_load(card.split("---\n")[1])["tags"][:2] == ["quantkit", "compressed-tensors"]
    section = card[card.index(EVAL_START) : card.index(EVAL_END)]
    assert NOT_EVALUATED not in section and f"| perplexity | {report['figures']['perplexity']:.4f} |" in section
    assert "min_quantized_fraction >= 0.9: 0.880952, FAIL" in section
    assert f"on `{text_corpus.name}`" in section and str(tmp_path) not in card


def test_the_size_gate_reads_the_checkpoint_files_megabytes() -> None:
    assert "max_checkpoint_mb" in GATES
    gates = GatesSection(max_checkpoint_mb=113.2)
    (gate,) = check_gates(gates, *QUALITY, quantized_fraction=1.0, size_mb=113.25)
    assert (gate.name, gate.comparison, gate.passed) == ("max_checkpoint_mb", "<=", False)
    assert gate.margin == pytest.approx(-0.05)
    (gate,) = check_gates(gates, *QUALITY, quantized_fraction=1.0, size_mb=100.0)
    assert gate.passed and gate.margin == pytest.approx(13.2)
    with pytest.raises(RecipeError, match=r"gates\.max_checkpoint_mb"):
        recipe_from_text("model: m\noutput: {directory: o}\ngates: {max_checkpoint_mb: 0}\n")
