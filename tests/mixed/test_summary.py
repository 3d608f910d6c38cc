"""The sensitivity default (hybrid, written once) and the per-candidate summary, robust to an outlier unit."""

from __future__ import annotations

import statistics

import pytest
from helpers.cli import run_cli

from quantkit.mixed.candidates import parse_candidate, unit_storage_bits
from quantkit.mixed.measurement import DEFAULT_MODE, CandidateCost, Measurement, UnitMeasurement
from quantkit.mixed.summary import outlier_units, render_summary, summarize

CANDIDATES = ["int4-g128", "int4-g64", "int4-g32", "int8", "fp16"]
SHAPES = {"self_attn.qkv": [(64, 64)] * 3, "self_attn.o_proj": [(64, 64)], "mlp.down_proj": [(64, 256)]}
OUTLIER = "model.layers.3.mlp.down_proj"


def _measurement(outlier: bool, layers: int = 6) -> Measurement:
    """Errors falling with the group size (g32 < g64 < g128), scales varying over a decade across units; with
    ``outlier``, layers.3's down_proj errs 1000x more and its solver did better with bigger groups (inverted)."""
    units = []
    for layer in range(layers):
        for i, (name, shapes) in enumerate(SHAPES.items()):
            scale = 1e-3 * (1 + layer + 3 * i) / 5
            ratios = {"int4-g128": 1.0, "int4-g64": 0.88, "int4-g32": 0.75, "int8": 0.01, "fp16": 0.0}
            full = f"model.layers.{layer}.{name}"
            if outlier and full == OUTLIER:
                scale, ratios = 1.0, {"int4-g128": 1.0, "int4-g64": 1.3, "int4-g32": 1.6, "int8": 0.01, "fp16": 0.0}
            options = {
                c: CandidateCost(scale * ratios[c], unit_storage_bits(parse_candidate(c), shapes)) for c in CANDIDATES
            }
            modules = [f"{full}.{m}" for m in ("q_proj", "k_proj", "v_proj")] if name.endswith("qkv") else [full]
            units.append(UnitMeasurement(full, modules, sum(n * k for n, k in shapes), options))
    return Measurement("tiny", "hybrid", CANDIDATES, units)


def test_the_default_mode_is_hybrid_everywhere() -> None:
    from quantkit.mixed.sensitivity import SensitivityConfig
    from quantkit.recipes.schema import MixedSection

    assert DEFAULT_MODE == "hybrid"
    assert SensitivityConfig().mode == DEFAULT_MODE
    assert MixedSection(target_bits=4.5).mode == DEFAULT_MODE


def test_sensitivity_help_names_the_default_and_the_fast_option(capsys) -> None:
    code, out, _ = run_cli(["sensitivity", "--help"], capsys)
    text = " ".join(out.replace("│", " ").split())
    assert code == 0
    assert "hybrid (default" in text and "proxy (the fast option" in text
    assert "[default: hybrid]" in text


def test_one_outlier_inverts_the_totals_but_not_the_summary() -> None:
    m = _measurement(outlier=True)
    totals = {c: sum(u.options[c].error for u in m.units) for c in ("int4-g128", "int4-g32")}
    assert totals["int4-g32"] > totals["int4-g128"]  # what a sum (or a plain mean) shows: g32 "worse"
    assert outlier_units(m) == [OUTLIER]
    summary = summarize(m)
    row = {r.name: r for r in summary.candidates}
    assert row["int4-g32"].median_error < row["int4-g64"].median_error < row["int4-g128"].median_error
    assert row["int4-g32"].mean_error < row["int4-g64"].mean_error < row["int4-g128"].mean_error
    kept = [u.options["int4-g32"].error for u in m.units if u.name != OUTLIER]
    assert row["int4-g32"].mean_error == pytest.approx(statistics.fmean(kept), rel=1e-12)
    assert row["int4-g32"].median_error == statistics.median(u.options["int4-g32"].error for u in m.units)
    assert row["int4-g32"].worst_unit == OUTLIER  # the worst unit is still shown
    assert row["fp16"].median_error == 0.0 and row["int4-g32"].units == len(m.units)
    assert summary.caption().endswith("layers.3.mlp.down_proj is an outlier (error >= 10x the median unit's): "
                                      "excluded from the means")  # fmt: skip


def test_no_outlier_is_named_in_an_ordinary_measurement() -> None:
    m = _measurement(outlier=False)
    assert outlier_units(m) == []
    summary = summarize(m)
    assert "no outlier units" in summary.caption() and "excluded" not in summary.caption()
    row = {r.name: r for r in summary.candidates}
    total = {c: sum(u.options[c].error for u in m.units) for c in CANDIDATES}
    assert row["int4-g64"].mean_error == pytest.approx(total["int4-g64"] / len(m.units), rel=1e-12)


def test_rendered_summary_names_the_outlier() -> None:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render_summary(summarize(_measurement(outlier=True)), "Sensitivity (hybrid) of tiny"))
    text = " ".join(console.export_text().split())
    assert "median error" in text and "mean error (no outliers)" in text
    assert "layers.3.mlp.down_proj is an outlier" in text and "excluded from the means" in text
    assert "18/18" in text  # units measured with each candidate, of all units


def test_a_candidate_no_unit_holds_is_shown_as_such() -> None:
    m = _measurement(outlier=False)
    m.candidates.append("int4-g32-asym")
    row = summarize(m).candidates[-1]
    assert (row.name, row.units, row.median_error, row.mean_error) == ("int4-g32-asym", 0, None, None)
