"""The behaviour gates (min_end_rate, max_repetition_increase, min_first32_agreement, min_tag_close_rate): read from
the evaluation's replies when the recipe's evaluation has `behaviour`, refused without it, the tag gate checked only
where the template has reasoning tags; a run on a model that never ends fails with a FAIL row, one on a model
that ends at once passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.chat_models import EOS, PROBE, emit_only, save_chat_model
from helpers.cli import run_cli

from quantkit.format.files import MODEL_CARD
from quantkit.recipes.report import GATES, check_gates
from quantkit.recipes.schema import BEHAVIOUR_GATES, GatesSection, RecipeError, recipe_from_text


def _evaluation(end_rate: float, repetition: float, reference_repetition: float, tags: bool) -> dict:
    """An evaluation's figures as `evaluate` returns them, with replies."""
    candidate = {"end_rate": end_rate, "repetition": repetition, "tag_close_rate": 0.25 if tags else None}
    return {
        "perplexity": 11.0,
        "kl_mean": 0.01,
        "top1_agreement": 0.9,
        "behaviour": {
            "reasoning_tags": ["<think>", "</think>"] if tags else None,
            "candidate": candidate,
            "first32_agreement": 0.75,
            "difference": {"repetition": repetition - reference_repetition},
        },
    }


def test_each_behaviour_gate_reads_its_figure() -> None:
    assert set(BEHAVIOUR_GATES) <= set(GATES)
    gates = GatesSection(
        min_end_rate=0.9, max_repetition_increase=0.05, min_first32_agreement=0.7, min_tag_close_rate=0.5
    )
    results = {g.name: g for g in check_gates(gates, _evaluation(0.8, 0.12, 0.1, True), {"perplexity": 10.0}, 1.0)}
    assert list(results) == list(BEHAVIOUR_GATES)
    end, repetition = results["min_end_rate"], results["max_repetition_increase"]
    assert (end.value, end.comparison, end.passed, end.margin) == (0.8, ">=", False, pytest.approx(-0.1))
    assert repetition.value == pytest.approx(0.02) and repetition.comparison == "<=" and repetition.passed
    assert results["min_first32_agreement"].passed and results["min_first32_agreement"].margin == pytest.approx(0.05)
    assert results["min_tag_close_rate"].value == 0.25 and not results["min_tag_close_rate"].passed


def test_the_tag_gate_is_not_checked_without_reasoning_tags() -> None:
    gates = GatesSection(min_end_rate=0.5, min_tag_close_rate=0.99)
    results = check_gates(gates, _evaluation(1.0, 0.0, 0.0, False), {"perplexity": 10.0}, 1.0)
    assert [g.name for g in results] == ["min_end_rate"] and results[0].passed


def test_behaviour_gates_need_the_evaluations_replies() -> None:
    base = "model: m\noutput: {directory: o}\n"
    with pytest.raises(RecipeError, match=r"gates\.min_end_rate.*add 'behaviour: true' to evaluation"):
        recipe_from_text(base + "gates: {min_end_rate: 0.9}\n")
    on = recipe_from_text(base + "evaluation: {behaviour: true}\ngates: {min_end_rate: 0.9}\n")
    assert on.evaluation.behaviour is not None and on.evaluation.behaviour.prompts == 32
    assert on.evaluation.behaviour.max_new_tokens == 128
    assert recipe_from_text(base + "evaluation: {behaviour: false}\n").evaluation.behaviour is None
    custom = recipe_from_text(base + "evaluation: {behaviour: {prompts: 8, max_new_tokens: 64}}\n")
    assert custom.evaluation.behaviour.config(show_progress=False).prompts == 8
    with pytest.raises(RecipeError, match=r"evaluation\.behaviour\.prompts"):
        recipe_from_text(base + "evaluation: {behaviour: {prompts: 0}}\n")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))


def _run(tmp_path: Path, model: Path, gates: str, capsys) -> tuple[int, str, dict, str]:
    text = tmp_path / "text.txt"
    text.write_text("the a of and to in was her she he it that " * 40)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""\
model: {model}
calibration: {{dataset: {text}, num_samples: 4, seq_len: 32}}
quantization: {{solvers: [rtn], scheme: {{bits: 4, group_size: 32}}}}
output: {{directory: {tmp_path / "ckpt"}, force: true}}
evaluation: {{dataset: {text}, seq_len: 32, windows: 1, behaviour: {{prompts: 4, max_new_tokens: 12}}}}
gates: {gates}
""")
    code, _, err = run_cli(["run", str(recipe), "--report", str(tmp_path / "report")], capsys)
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    return code, " ".join(err.split()), report, (tmp_path / "report" / "report.md").read_text()


def test_a_checkpoint_that_never_ends_its_replies_fails_the_gate(tmp_path, capsys) -> None:
    model = save_chat_model(tmp_path / "repeats", edit=emit_only(PROBE))
    gates = "{min_end_rate: 0.5, max_repetition_increase: 0.1, min_tag_close_rate: 0.9}"
    code, err, report, markdown = _run(tmp_path, model, gates, capsys)
    assert code == 1, err
    assert "gate failed: min_end_rate: measured 0, threshold >= 0.5, missed by 0.5" in err
    assert "max_repetition_increase" not in err  # it repeats as much as its reference does: that gate passes
    assert [g["name"] for g in report["gates"]] == ["min_end_rate", "max_repetition_increase"]  # no tags: no tag gate
    assert report["figures"]["end rate"] == 0.0 and report["figures"]["repetition"] == pytest.approx(8 / 9)
    assert "| min_end_rate | >= 0.5 | 0 | -0.5 | FAIL |" in markdown
    assert "| end rate (replies) | 0.000 |" in markdown


def test_a_checkpoint_that_ends_every_reply_passes(tmp_path, capsys) -> None:
    model = save_chat_model(tmp_path / "stops", edit=emit_only(EOS))
    gates = "{min_end_rate: 1.0, max_repetition_increase: 0.0, min_first32_agreement: 1.0}"
    code, err, report, markdown = _run(tmp_path, model, gates, capsys)
    assert code == 0, err
    assert report["passed"] and [g["passed"] for g in report["gates"]] == [True, True, True]
    assert report["figures"]["end rate"] == 1.0 and report["figures"]["first-32 agreement"] == 1.0
    assert "| min_first32_agreement | >= 1 | 1 | +0 | PASS |" in markdown
    card = (tmp_path / "ckpt" / MODEL_CARD).read_text()  # the checkpoint's card carries the figures and verdicts
    assert "| end rate (replies) | 1.000 |" in card and "min_end_rate >= 1: 1, pass" in card
