"""``sensitivity --rotate hadamard``: the units are measured on the model a rotated ``quantize`` run solves. The
rotated whole model keeps the float model's logits (the rotation is exact), gets a head of its own, and the
streamed (proxy) and loaded (kl, hybrid) ways of folding measure the same weights; the measurement records the
rotation, its errors differ from the unrotated model's, and a whole-model plan of a tied model needs no
--untied-head when the measurement is rotated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.cli import cli_exit_code, run_cli
from helpers.tiny import build_word_tokenizer, perturb_norms, tiny_llama

from quantkit.mixed.measurement import load_measurement
from quantkit.mixed.sensitivity import SensitivityConfig, measure_sensitivity
from quantkit.model.resolve import arch_for_dir, load_model
from quantkit.model.source_weights import SourceWeights
from quantkit.quantization.methods.rotation import RotationConfig, job_rotation, rotate_loaded_model

pytestmark = pytest.mark.slow  # each test measures a tiny model

CANDIDATES = ["int4-g32", "int8", "fp16"]


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama with a tied head and norms that are not ones (so folding them matters)."""
    path = tmp_path_factory.mktemp("tied") / "model"
    model = tiny_llama(bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    perturb_norms(model)
    model.save_pretrained(path)
    build_word_tokenizer().save_pretrained(path)
    return path


def test_the_rotated_model_keeps_the_logits_and_unties_the_head(tied_model_dir) -> None:
    model = load_model(tied_model_dir)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
    arch = arch_for_dir(tied_model_dir)
    with SourceWeights(tied_model_dir) as weights:
        rotation = job_rotation(RotationConfig(), tied_model_dir, arch, weights)
        rotate_loaded_model(model, rotation, rotation.outer_tensors(weights))
        original_table = weights.get("model.embed_tokens.weight")
    assert model.lm_head.weight is not model.model.embed_tokens.weight and not model.config.tie_word_embeddings
    assert not torch.allclose(model.model.embed_tokens.weight, original_table)  # the table itself is rotated
    assert torch.all(model.model.norm.weight == 1.0)  # the final norm's scale went into the head
    with torch.inference_mode():
        rotated = model(input_ids=ids).logits
    assert float((rotated - expected).abs().max()) < 1e-4 * float(expected.abs().max())


def _measure(model_dir: Path, calib: Path, mode: str, rotate: bool, outer: bool = False):
    config = SensitivityConfig(
        candidates=list(CANDIDATES),
        mode=mode,
        calibration_file=calib,
        show_progress=False,
        outer=outer,
        outer_candidates=["int8", "w4g32"],
        rotation=RotationConfig() if rotate else None,
    )
    return measure_sensitivity(model_dir, config)


def test_streamed_and_loaded_folds_measure_the_same_weights(tied_model_dir, tiny_calib_file) -> None:
    """proxy mode folds each block as it streams in (as quantize does); kl and hybrid fold the loaded model. The
    hybrid errors are the proxy errors rescaled per unit, so the two agree on every ratio within a unit."""
    proxy = _measure(tied_model_dir, tiny_calib_file, "proxy", rotate=True)
    hybrid = _measure(tied_model_dir, tiny_calib_file, "hybrid", rotate=True)
    for p, h in zip(proxy.units, hybrid.units, strict=True):
        assert p.name == h.name
        ratio_p = p.options["int8"].error / p.options["int4-g32"].error
        ratio_h = h.options["int8"].error / h.options["int4-g32"].error
        assert ratio_h == pytest.approx(ratio_p, rel=1e-3)


def test_the_measurement_records_the_rotation_and_differs_from_the_unrotated_one(
    tied_model_dir, tiny_calib_file
) -> None:
    plain = _measure(tied_model_dir, tiny_calib_file, "proxy", rotate=False)
    rotated = _measure(tied_model_dir, tiny_calib_file, "proxy", rotate=True)
    assert plain.rotation is None
    assert rotated.rotation == {"kind": "hadamard", "seed": 0, "rotate_heads": True}
    assert [u.name for u in rotated.units] == [u.name for u in plain.units]
    # same bits (same shapes), other errors: the rotation changes the weights every unit solves
    for p, r in zip(plain.units, rotated.units, strict=True):
        assert {c: o.bits for c, o in p.options.items()} == {c: o.bits for c, o in r.options.items()}
    pairs = zip(plain.units, rotated.units, strict=True)
    changed = [abs(r.options["int4-g32"].error / p.options["int4-g32"].error - 1) for p, r in pairs]
    assert max(changed) > 0.05


def test_a_rotated_measurement_plans_the_tied_models_head_without_untied_head(
    tied_model_dir, tiny_calib_file, tmp_path, capsys
) -> None:
    measurement = tmp_path / "m.json"
    args = ["sensitivity", str(tied_model_dir), "-o", str(measurement), "--calib", str(tiny_calib_file)]
    options = ["--candidates", ",".join(CANDIDATES), "--outer", "--outer-candidates", "int8,w4g32"]
    assert cli_exit_code([*args, *options, "--rotate", "hadamard"]) == 0
    head = load_measurement(measurement).outer_unit("head")
    assert head is not None and head.options["w4g32"].error > head.options["int8"].error > 0.0
    plan = tmp_path / "plan.yaml"
    plan_args = ["plan", str(measurement), "--whole-model", "--max-size-mb", "1", "-o", str(plan)]
    code, _, err = run_cli([*plan_args, "--head", "auto", "--embedding", "auto"], capsys)
    assert code == 0, err
    assert "untied_head: true" in plan.read_text()
    code, _, err = run_cli([*args, *options, "--rotate", "spin"], capsys)
    assert code != 0 and "unknown rotation kind 'spin'" in err
