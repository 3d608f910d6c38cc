"""`quantkit run`: stages, gates (exit 0/1), content-hash caching, smoke stage. recipes/ci.yaml on SmolLM2 runs
in .ci/run itself (`quantkit run recipes/ci.yaml`), so CI fails when its gates fail."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers.cli import run_cli

from quantkit.eval.evaluate import EvalConfig, evaluate

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _own_cache(request, tmp_path, monkeypatch):
    """Tiny-model tests get an empty cache; the e2e test keeps the shared one (the converted SmolLM2)."""
    if request.node.get_closest_marker("e2e") is None:
        monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))


def _recipe(
    tmp_path: Path, model: Path, corpus: Path, *, gates: str = "", extra: str = "", solver: str = "rtn"
) -> Path:
    text = f"""\
model: {model}
calibration: {{dataset: {corpus}, num_samples: 8, seq_len: 32}}
quantization:
  solvers: [{solver}]
  scheme: {{bits: 4, group_size: 32}}
output: {{directory: {tmp_path / "ckpt"}, force: true}}
evaluation: {{dataset: {corpus}, seq_len: 32, windows: 4}}
gates:
{gates or "  max_ppl_increase_pct: 1000"}
{extra}"""
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def _report(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "report" / "report.json").read_text())


def _run(recipe: Path, tmp_path: Path, capsys, *extra: str) -> tuple[int, str, str]:
    return run_cli(["run", str(recipe), "--report", str(tmp_path / "report"), *extra], capsys)


def test_failing_gate_exits_1_and_names_the_gate(tiny_model_dir, text_corpus, tmp_path, capsys):
    recipe = _recipe(tmp_path, tiny_model_dir, text_corpus, gates="  max_kl_mean: 0\n  min_top1_agreement: 0.0")
    code, _, err = _run(recipe, tmp_path, capsys)
    assert code == 1, err
    assert "gate failed: max_kl_mean: measured" in err and "min_top1_agreement" not in err
    report = _report(tmp_path)
    assert report["passed"] is False
    kl = next(g for g in report["gates"] if g["name"] == "max_kl_mean")
    assert kl["passed"] is False and kl["threshold"] == 0 and kl["value"] > 0 and kl["margin"] == -kl["value"]
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "FAILED" in markdown and "| max_kl_mean |" in markdown


def test_passing_gates_exit_0_with_a_full_report(tiny_model_dir, text_corpus, tmp_path, capsys):
    gates = "  max_ppl_increase_pct: 1000\n  max_kl_mean: 100\n  min_top1_agreement: 0.0"
    code, out, err = _run(_recipe(tmp_path, tiny_model_dir, text_corpus, gates=gates), tmp_path, capsys)
    assert code == 0, err
    assert "all gates passed" in out
    report = _report(tmp_path)
    assert report["passed"] and len(report["gates"]) == 3 and all(g["passed"] for g in report["gates"])
    assert {"perplexity", "baseline perplexity", "kl mean", "top-1 agreement"} <= set(report["figures"])
    assert [s["name"] for s in report["stages"]] == ["model", "calibrate", "quantize", "evaluate", "baseline"]
    assert {"python", "torch", "transformers", "quantkit", "platform"} <= set(report["environment"])
    assert {"model", "calibration", "checkpoint files", "evaluation text"} <= set(report["hashes"])
    # the baseline is the reference's perplexity from the checkpoint's evaluation: no second pass, same figure
    alone = evaluate(str(tiny_model_dir), EvalConfig(dataset=str(text_corpus), seq_len=32, max_windows=4))
    assert report["figures"]["baseline perplexity"] == pytest.approx(alone.perplexity, rel=1e-4)
    baseline = next(s for s in report["stages"] if s["name"] == "baseline")
    assert baseline["seconds"] < 0.5 * next(s for s in report["stages"] if s["name"] == "evaluate")["seconds"]


@pytest.mark.slow
def test_cache_reuses_unchanged_work_and_a_changed_text_invalidates(tiny_model_dir, text_corpus, tmp_path, capsys):
    recipe = _recipe(tmp_path, tiny_model_dir, text_corpus, solver="gptq")
    assert _run(recipe, tmp_path, capsys)[0] == 0
    assert not any(s["cached"] for s in _report(tmp_path)["stages"][1:])
    checkpoint = (tmp_path / "ckpt" / "model.safetensors").stat().st_mtime_ns

    assert _run(recipe, tmp_path, capsys)[0] == 0
    cached = {s["name"]: s["cached"] for s in _report(tmp_path)["stages"]}
    assert cached == {"model": False, "calibrate": True, "quantize": True, "evaluate": True, "baseline": True}
    assert (tmp_path / "ckpt" / "model.safetensors").stat().st_mtime_ns == checkpoint  # not written again

    text_corpus.write_text(text_corpus.read_text().replace("the", "a"))
    assert _run(recipe, tmp_path, capsys)[0] == 0
    cached = {s["name"]: s["cached"] for s in _report(tmp_path)["stages"]}
    assert not cached["calibrate"] and not cached["quantize"]
    assert not cached["evaluate"] and not cached["baseline"]  # the evaluation text changed as well


def test_stale_output_without_force_is_an_input_error(tiny_model_dir, text_corpus, tmp_path, capsys):
    recipe = _recipe(tmp_path, tiny_model_dir, text_corpus)
    assert _run(recipe, tmp_path, capsys)[0] == 0
    code, _, err = _run(recipe, tmp_path, capsys, "--set", "output.force=false", "--set", "quantization.scheme.bits=8")
    assert code == 2 and "scheme differ" in err and "output.force" in err


@pytest.mark.slow
def test_mixed_recipe_runs_sensitivity_and_plan(tiny_model_dir, text_corpus, tmp_path, capsys):
    recipe = _recipe(tmp_path, tiny_model_dir, text_corpus)
    text = recipe.read_text().replace(
        "  scheme: {bits: 4, group_size: 32}", "  mixed: {target_bits: 6, candidates: [int4-g32, int8, fp16]}"
    )
    recipe.write_text(text)
    code, _, err = _run(recipe, tmp_path, capsys)
    assert code == 0, err
    report = _report(tmp_path)
    assert [s["name"] for s in report["stages"]][2:4] == ["sensitivity", "plan"]
    assert report["figures"]["planned bits per weight"] <= 6


@dataclass
class _FakeSmoke:
    ok: bool
    failures: list[str] = field(default_factory=list)
    requests: int = 3
    seconds: float = 0.1

    def to_dict(self) -> dict:
        return {"ok": self.ok, "failures": self.failures, "requests": self.requests, "seconds": self.seconds}


@pytest.mark.parametrize("ok", [True, False])
def test_smoke_stage_calls_run_smoke_and_decides_the_exit(
    tiny_model_dir, text_corpus, tmp_path, capsys, monkeypatch, ok
):
    calls = []

    def run_smoke(model, prompts=None, max_tokens=16):
        calls.append((Path(model), prompts, max_tokens))
        return _FakeSmoke(ok, [] if ok else ["chat: output differs from the offline engine"])

    monkeypatch.setitem(sys.modules, "quantkit.server.smoke", types.SimpleNamespace(run_smoke=run_smoke))
    extra = "smoke: {enabled: true, prompts: [Hello], max_tokens: 4}\n"
    code, _, err = _run(_recipe(tmp_path, tiny_model_dir, text_corpus, extra=extra), tmp_path, capsys)
    assert calls == [(tmp_path / "ckpt", ["Hello"], 4)]
    assert code == (0 if ok else 1)
    assert _report(tmp_path)["smoke"]["ok"] is ok
    if not ok:
        assert "smoke: chat: output differs" in err


def test_secret_named_variables_are_redacted_from_reports(tiny_model_dir, text_corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RUN_API_KEY", "sk-live-0123456789")
    monkeypatch.setenv("NUM_TOKENS", "ckpt")  # TOKENS is not a secret word: kept
    recipe = _recipe(tmp_path, tiny_model_dir, text_corpus)
    text = recipe.read_text().replace(str(tmp_path / "ckpt"), f'"{tmp_path}/${{NUM_TOKENS}}-${{RUN_API_KEY}}"')
    recipe.write_text(text)
    code, _, err = _run(recipe, tmp_path, capsys)
    assert code == 0, err
    for name in ("report.json", "report.md"):
        written = (tmp_path / "report" / name).read_text()
        assert "sk-live-0123456789" not in written and "ckpt-<redacted ${RUN_API_KEY}>" in written
    assert _report(tmp_path)["figures"]["perplexity"] > 0


def test_a_warning_in_a_stage_is_one_line(tiny_model_dir, text_corpus, tmp_path, capsys):
    """A forced small calibration text warns inside the recipe's quantize stage: one yellow line, no source excerpt."""
    small = tmp_path / "small.txt"
    small.write_text("It is a truth universally acknowledged that a single man must be in want of a wife. " * 6)
    recipe = _recipe(tmp_path, tiny_model_dir, text_corpus, solver="gptq")
    recipe.write_text(
        recipe.read_text().replace(
            f"dataset: {text_corpus}, num_samples", f"dataset: {small}, allow_small: true, num_samples"
        )
    )
    code, _, err = _run(recipe, tmp_path, capsys)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "windows overlap" in warnings[0], err
    assert "warnings.warn" not in err and ".py:" not in err
