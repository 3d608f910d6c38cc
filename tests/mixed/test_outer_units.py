"""The head and the embedding as planned units: ``sensitivity --outer`` measures them by final-logit KL,
``plan --whole-model --head auto --embedding auto`` chooses their schemes jointly with the linears (exactly: the same
least error as a brute force over the head and embedding choices with the linears planned alone), ``quantize --plan``
writes them, and the files fit the budget; tied heads and measurements without the units are refused."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers.cli import cli_exit_code, run_cli
from helpers.tiny import save_tiny_model

from quantkit.errors import QuantkitError
from quantkit.format.files import shard_files
from quantkit.mixed.measurement import load_measurement
from quantkit.mixed.plan_file import dump_plan, load_plan
from quantkit.mixed.planner import plan
from quantkit.mixed.sensitivity import SensitivityConfig, measure_sensitivity
from quantkit.mixed.whole_model import header_bits, outer_tables
from quantkit.mixed.whole_plan import whole_model_plan

OUTER = ["int8", "w4g32", "w2g32"]  # the tiny model's hidden size is 64: g32 divides it


@pytest.fixture(scope="module")
def measured(tiny_model_dir, tiny_calib_file, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("outer") / "m.json"
    args = ["sensitivity", str(tiny_model_dir), "-o", str(path), "--calib", str(tiny_calib_file)]
    code = cli_exit_code(
        [*args, "--candidates", "int4-g32,int8,fp16", "--outer", "--outer-candidates", ",".join(OUTER)]
    )
    assert code == 0
    return path


def _bytes_on_disk(checkpoint: Path) -> int:
    return sum(f.stat().st_size for f in shard_files(checkpoint))  # as the recipes' max_checkpoint_mb gate counts


def test_sensitivity_measures_the_head_and_the_embedding_by_kl(measured):
    m = load_measurement(measured)
    assert [(o.name, o.module) for o in m.outer] == [("head", "lm_head"), ("embedding", "model.embed_tokens")]
    assert m.metadata["outer_solvers"] == {"head": "gptq", "embedding": "rtn"}
    for unit in m.outer:
        assert list(unit.options) == ["none", *OUTER] and unit.params == 256 * 64
        errors = [unit.options[s].error for s in ["none", *OUTER]]
        bits = [unit.options[s].bits for s in ["none", *OUTER]]
        assert errors[0] == 0.0 and all(a < b for a, b in itertools.pairwise(errors))  # KL grows as bits drop
        assert all(a > b for a, b in itertools.pairwise(bits))
        assert bits[0] == 256 * 64 * 32  # the float32 source's own bytes
        assert unit.options["int8"].bits == 256 * 64 * 8 + 256 * 16 + 128  # codes, a 16-bit scale a row, the shape


def test_the_embedding_error_is_the_final_logit_kl_on_the_kl_windows(measured, tiny_model_dir, tiny_calib_file):
    """Recomputed by hand: the rounded table in the float model, KL of the last distributions on the first two
    windows (the linears' kl/hybrid errors are the same quantity)."""
    from quantkit.data.calibration import CalibrationSet
    from quantkit.eval.logit_metrics import token_kl
    from quantkit.model.resolve import load_model
    from quantkit.quantization.methods.head_quant import head_scheme
    from quantkit.quantization.solvers.grid import quantize_rtn

    model = load_model(tiny_model_dir)
    ids = CalibrationSet.load(tiny_calib_file).input_ids[:2]
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
        table = model.model.embed_tokens.weight
        rounded = quantize_rtn(table, head_scheme("w4g32", "rtn"), scale_dtype=torch.float32).dequantize()
        model.model.embed_tokens.weight.copy_(rounded)
        kl = float(token_kl(reference, model(input_ids=ids).logits).mean())
    measured_kl = load_measurement(measured).outer_unit("embedding").options["w4g32"].error
    assert measured_kl == pytest.approx(kl, rel=1e-4) and kl > 0


def test_old_measurements_load_and_outer_needs_kl(measured, tmp_path, tiny_model_dir):
    data = json.loads(measured.read_text())
    data.pop("outer")
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert load_measurement(old).outer == []
    data["outer"] = [{"name": "head", "module": "lm_head", "params": 1, "options": {"int9": {"error": 0, "bits": 8}}}]
    old.write_text(json.dumps(data))
    with pytest.raises(QuantkitError, match="unknown head scheme 'int9'"):
        load_measurement(old)
    with pytest.raises(QuantkitError, match="use --mode hybrid"):
        measure_sensitivity(tiny_model_dir, SensitivityConfig(mode="proxy", outer=True))


def test_a_generous_budget_keeps_them_float_and_a_tight_one_quantizes_them(measured, tiny_model_dir):
    m = load_measurement(measured)
    roomy = whole_model_plan(m, tiny_model_dir, 5.0, head="auto", embedding="auto")
    assert [(o.name, o.scheme) for o in roomy.outer] == [("head", "none"), ("embedding", "none")]
    assert all(u.candidate == "fp16" for u in roomy.units) and roomy.whole_error == 0.0
    tight = whole_model_plan(m, tiny_model_dir, 0.14, head="auto", embedding="auto")
    assert tight.outer_scheme("head") != "none" and tight.outer_scheme("embedding") != "none"
    assert tight.whole_model_mb <= 0.14


@pytest.mark.parametrize("budget_mb", [0.12, 0.14, 0.2, 0.3, 0.5])
def test_the_joint_plan_is_the_brute_force_optimum(measured, tiny_model_dir, budget_mb):
    m = load_measurement(measured)
    head, embedding = (list(m.outer_unit(n).options) for n in ("head", "embedding"))
    tables = outer_tables(m, tiny_model_dir, head, embedding)
    rest = tables.rest_bits + header_bits(m, tiny_model_dir, budget_mb)
    best = None
    for h, e in itertools.product(head, embedding):  # the linears planned alone for each outer choice
        try:
            alone = plan(m, max_size_mb=budget_mb, outer_bits=rest + tables.head[h] + tables.embedding[e])
        except QuantkitError:
            continue
        total = (
            alone.predicted_error + m.outer_unit("head").options[h].error + m.outer_unit("embedding").options[e].error
        )
        best = total if best is None else min(best, total)
    joint = whole_model_plan(m, tiny_model_dir, budget_mb, head="auto", embedding="auto")
    assert best is not None and joint.whole_error == pytest.approx(best, rel=1e-9, abs=1e-15)
    assert joint.whole_model_mb <= budget_mb


def test_quantize_with_the_plan_writes_them_within_the_budget(
    measured, tiny_model_dir, tiny_calib_file, tmp_path, capsys
):
    budget = 0.135
    plan_path = tmp_path / "plan.yaml"
    args = ["plan", str(measured), "-o", str(plan_path), "--whole-model", "--max-size-mb", str(budget)]
    code, out, err = run_cli([*args, "--head", "auto", "--embedding", "auto"], capsys)
    assert code == 0, err
    outer = yaml.safe_load(plan_path.read_text())["outer"]
    head, embedding = outer["head"]["scheme"], outer["embedding"]["scheme"]
    assert head != "none" and embedding != "none" and outer["untied_head"] is False
    text = " ".join(out.split())
    assert f"--quantize-head {head} --quantize-embedding {embedding}" in text and "--rotate" not in text
    assert dump_plan(load_plan(plan_path)) == plan_path.read_text()  # the outer section survives a round trip
    checkpoint = tmp_path / "ckpt"
    quantize = ["quantize", str(tiny_model_dir), "-o", str(checkpoint), "--plan", str(plan_path), "--method", "rtn"]
    code, _, err = run_cli([*quantize, "--calib", str(tiny_calib_file)], capsys)
    assert code == 0, err
    assert _bytes_on_disk(checkpoint) <= budget * 1e6
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    targets = {t for group in config["config_groups"].values() for t in group["targets"]}
    assert {"lm_head", "model.embed_tokens"} <= targets
    code, _, err = run_cli([*quantize, "--quantize-head", "w2g32", "--calib", str(tiny_calib_file)], capsys)
    assert code == 2 and f"sized the checkpoint with --quantize-head {head}" in " ".join(err.split())


def test_auto_without_the_units_or_on_a_tied_head_is_refused(measured, tmp_path, capsys):
    data = json.loads(measured.read_text())
    data.pop("outer")
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    args = ["plan", str(old), "-o", str(tmp_path / "p.yaml"), "--whole-model", "--max-size-mb", "0.2"]
    code, _, err = run_cli([*args, "--head", "auto"], capsys)
    assert code == 2 and "re-run `quantkit sensitivity" in err and "--outer" in " ".join(err.split())
    tied = save_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    m = load_measurement(measured)
    m.model = str(tied)
    with pytest.raises(QuantkitError, match="ties its head to the embedding"):
        whole_model_plan(m, tied, 0.14, embedding="auto")
    with pytest.raises(QuantkitError, match="ties its head to the embedding"):
        whole_model_plan(m, tied, 0.14, head="int8")
    untied = whole_model_plan(m, tied, 0.14, head="auto", embedding="auto", untied_head=True)
    assert untied.untied_head and untied.whole_model_mb <= 0.14
    floated = whole_model_plan(m, tied, 0.2)  # a tied head: no head unit, the float embedding its only choice
    assert [(o.name, o.scheme) for o in floated.outer] == [("embedding", "none")]


def test_a_tied_model_measures_both_units_without_changing_the_other(tmp_path, tiny_calib_file):
    tied = save_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    config = SensitivityConfig(calibration_file=tiny_calib_file, candidates=["int8"], outer=True, show_progress=False)
    config.outer_candidates = ["w2g32"]
    first, second = (measure_sensitivity(tied, config) for _ in range(2))
    head, embedding = (first.outer_unit(n).options["w2g32"].error for n in ("head", "embedding"))
    assert head > 0 and embedding > 0 and head != pytest.approx(embedding, rel=1e-3)
    assert second.outer_unit("head").options["w2g32"].error == pytest.approx(head, rel=1e-6)  # the model restored
    assert torch.equal(torch.tensor(second.outer_unit("embedding").options["w2g32"].error), torch.tensor(embedding))


def test_a_recipe_gets_the_planned_head_and_embedding_and_may_not_write_others(measured, tiny_model_dir, tmp_path):
    from quantkit.mixed.plan_apply import with_planned_outer_configs
    from quantkit.mixed.plan_file import save_plan
    from quantkit.quantization.methods.embed_quant import EmbedQuantConfig
    from quantkit.quantization.methods.gptq import GPTQConfig
    from quantkit.quantization.methods.head_quant import HeadQuantConfig

    chosen = whole_model_plan(load_measurement(measured), tiny_model_dir, 0.14, head="auto", embedding="auto")
    path = save_plan(chosen, tmp_path / "plan.yaml")
    head, embedding = chosen.outer_scheme("head"), chosen.outer_scheme("embedding")
    assert head is not None and embedding is not None and "none" not in (head, embedding)
    planned = [HeadQuantConfig(head), EmbedQuantConfig(embedding)]
    assert with_planned_outer_configs(path, planned) == planned  # written as planned: kept
    added = with_planned_outer_configs(path, [EmbedQuantConfig(embedding), GPTQConfig()])  # the head left out
    assert added == [GPTQConfig(), HeadQuantConfig(head), EmbedQuantConfig(embedding)]  # in run order
    other = "w2g32" if embedding != "w2g32" else "int8"
    with pytest.raises(QuantkitError, match=f"set `embed_quant: {{scheme: {embedding}}}`"):
        with_planned_outer_configs(path, [HeadQuantConfig(head), EmbedQuantConfig(other)])


def test_a_rotated_tied_model_fits_the_budget_with_the_planned_head(tmp_path, tiny_calib_file, capsys):
    tied = save_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    sens, plan_path, budget = tmp_path / "m.json", tmp_path / "plan.yaml", 0.13
    args = ["sensitivity", str(tied), "-o", str(sens), "--calib", str(tiny_calib_file), "--outer"]
    assert run_cli([*args, "--candidates", "int4-g32,int8,fp16", "--outer-candidates", "int8,w4g32"], capsys)[0] == 0
    args = ["plan", str(sens), "-o", str(plan_path), "--whole-model", "--max-size-mb", str(budget)]
    code, out, err = run_cli([*args, "--head", "auto", "--embedding", "auto", "--untied-head"], capsys)
    assert code == 0, err
    outer = yaml.safe_load(plan_path.read_text())["outer"]
    assert "--rotate hadamard" in " ".join(out.split()) and outer["untied_head"] and outer["head"]["scheme"] != "none"
    checkpoint = tmp_path / "ckpt"
    quantize = ["quantize", str(tied), "-o", str(checkpoint), "--plan", str(plan_path), "--method", "rtn"]
    quantize += ["--calib", str(tiny_calib_file)]
    code, _, err = run_cli(quantize, capsys)
    assert code == 2 and "add --rotate hadamard" in " ".join(err.split())  # the plan's head needs the untying run
    assert run_cli([*quantize, "--rotate", "hadamard"], capsys)[0] == 0
    assert _bytes_on_disk(checkpoint) <= budget * 1e6


@pytest.mark.slow
def test_a_recipe_plans_the_whole_model_head_and_embedding_included(tmp_path, text_corpus, capsys, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    tied = save_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    budget = 0.13
    mixed = (
        f"{{max_size_mb: {budget}, whole_model: true, head: auto, embedding: auto, "
        "candidates: [int4-g32, int8, fp16], outer_candidates: [int8, w4g32]}"
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model: {tied}\n"
        f"calibration: {{dataset: {text_corpus}, num_samples: 8, seq_len: 32}}\n"
        f"quantization:\n  solvers: [rotation, rtn]\n  mixed: {mixed}\n"
        f"output: {{directory: {tmp_path / 'ckpt'}, force: true}}\n"
        f"evaluation: {{dataset: {text_corpus}, seq_len: 32, windows: 4}}\n"
        f"gates: {{max_checkpoint_mb: {budget}}}\n"
    )
    code, _, err = run_cli(["run", str(recipe), "--report", str(tmp_path / "report")], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    plan_file = yaml.safe_load(Path(report["artifacts"]["plan"]).read_text())
    outer = plan_file["outer"]
    assert outer["untied_head"] is True  # the recipe's rotation unties the head: the plan paid for it
    coverage = {k["kind"]: k["schemes"] for k in report["coverage"]["kinds"]}
    for kind, name in (("head", "head"), ("embeddings", "embedding")):  # written as planned
        assert ("float" in coverage[kind]) == (outer[name]["scheme"] == "none")
    assert outer["head"]["scheme"] != "none" or outer["embedding"]["scheme"] != "none"
    assert _bytes_on_disk(tmp_path / "ckpt") <= budget * 1e6 and report["passed"]
    measurement = load_measurement(Path(report["artifacts"]["measurement"]))
    assert [o.name for o in measurement.outer] == ["head", "embedding"]
