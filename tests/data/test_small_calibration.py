"""A calibration text shorter than the tokens its windows ask for: a warning, below the floor a refusal that
says how much text the request needs and how to force it, and the force flag (CLI and recipes)."""

from __future__ import annotations

import warnings

import pytest
from helpers.cli import run_cli

from quantkit.data.calibration import (
    MIN_TEXT_COVERAGE,
    CalibrationConfig,
    SmallCalibrationWarning,
    TextCoverage,
    build_calibration,
    check_text_coverage,
)
from quantkit.errors import CalibrationError


@pytest.fixture
def small_text(tmp_path):
    """About 150 tokens of the tiny word tokenizer (120 words and their punctuation)."""
    sentence = "It was the best of times, it was the worst of times, and all of us were going there. "
    path = tmp_path / "small.txt"
    path.write_text(sentence * 6)
    return path


def _tokens(model, path) -> int:
    from quantkit.data.sources import load_documents
    from quantkit.data.tokens import encode_documents, join_documents
    from quantkit.model.resolve import load_tokenizer

    tokenizer = load_tokenizer(str(model))
    docs = load_documents(str(path))
    return len(join_documents(encode_documents(tokenizer, docs.texts, show_progress=False), tokenizer.eos_token_id))


def _config(path, num_samples, **kw):
    return CalibrationConfig(dataset=str(path), num_samples=num_samples, seq_len=32, show_progress=False, **kw)


def test_coverage_thresholds_and_the_amount_of_text_needed():
    # 724 tokens of text stretched over 8 windows of 512: 18% coverage, under the floor
    small = TextCoverage(text_tokens=724, windows=8, window_tokens=512, bytes_per_token=4.4, words_per_token=0.75)
    assert small.requested_tokens == 4096 and small.fraction == pytest.approx(724 / 4096)
    with pytest.raises(CalibrationError) as refused:
        check_text_coverage(small, allow_small=False)
    message = str(refused.value)
    assert "\n" not in message
    for part in ("724 tokens", "18%", "4,096", "about 3,100 words, 18 KB", "--allow-small-calibration", "25%"):
        assert part in message, part
    with pytest.warns(SmallCalibrationWarning, match="windows overlap"):
        check_text_coverage(small, allow_small=True)
    at_floor = TextCoverage(1024, 8, 512, 4.0, 0.75)
    assert at_floor.fraction == MIN_TEXT_COVERAGE
    with pytest.warns(SmallCalibrationWarning, match="each token seen ~4.0 times"):
        check_text_coverage(at_floor, allow_small=False)  # at the floor: a warning, not a refusal
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_text_coverage(TextCoverage(4096, 8, 512, 4.0, 0.75), allow_small=False)  # enough text: silent


def test_small_text_warns_refuses_or_is_forced(tiny_model_dir, small_text):
    tokens = _tokens(tiny_model_dir, small_text)
    assert 120 < tokens < 200
    warn_samples = tokens // 32 + 1  # asks for a little more than the text holds
    with pytest.warns(SmallCalibrationWarning, match=f"has {tokens:,} tokens, fewer than the {warn_samples * 32:,}"):
        result = build_calibration(str(tiny_model_dir), _config(small_text, warn_samples))
    assert tuple(result.calibration.input_ids.shape) == (warn_samples, 32)

    refuse_samples = 4 * tokens // 32 + 1  # the text covers under a quarter of the request
    with pytest.raises(CalibrationError, match="--allow-small-calibration to use it anyway") as refused:
        build_calibration(str(tiny_model_dir), _config(small_text, refuse_samples))
    assert f"give at least {refuse_samples * 32:,} tokens (about" in str(refused.value)

    with pytest.warns(SmallCalibrationWarning):
        forced = build_calibration(str(tiny_model_dir), _config(small_text, refuse_samples, allow_small=True))
    assert tuple(forced.calibration.input_ids.shape) == (refuse_samples, 32)


def test_enough_text_does_not_warn(tiny_model_dir, text_corpus):
    with warnings.catch_warnings():
        warnings.simplefilter("error", SmallCalibrationWarning)
        build_calibration(str(tiny_model_dir), _config(text_corpus, 8))


def test_calibrate_cli_refuses_in_one_line_then_is_forced(tiny_model_dir, small_text, tmp_path, capsys):
    out = tmp_path / "calib.safetensors"
    args = ["calibrate", "-m", str(tiny_model_dir), "--dataset", str(small_text), "--seq-len", "32", "-o", str(out)]
    code, _, err = run_cli([*args, "--num-samples", "40"], capsys)
    assert code == 2, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err and len(errors) == 1 and errors[0].startswith("error:")
    assert "--allow-small-calibration" in err and "KB" in err
    assert not out.exists()

    code, stdout, err = run_cli([*args, "--num-samples", "40", "--allow-small-calibration"], capsys)
    assert code == 0, err
    assert out.is_file() and "40 x 32" in stdout
    warning_lines = [line for line in err.splitlines() if "warning:" in line]
    assert len(warning_lines) == 1 and "windows overlap" in err and "Traceback" not in err

    code, _, err = run_cli([*args, "--num-samples", "5"], capsys)  # 160 of ~150 tokens: a warning only
    assert code == 0 and "warning:" in err and "windows overlap" in err


def test_quantize_with_a_tiny_text_refuses_before_writing_anything(tiny_model_dir, small_text, tmp_path, capsys):
    output = tmp_path / "q"
    args = ["quantize", str(tiny_model_dir), "-o", str(output), "--method", "gptq", "--group-size", "32"]
    code, _, err = run_cli([*args, "--dataset", str(small_text), "--num-samples", "64", "--seq-len", "32"], capsys)
    assert code == 2, err
    assert "Traceback" not in err and "--allow-small-calibration" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.txt"]  # nothing under the output name


def test_quantize_can_be_forced_to_use_a_tiny_text(tiny_model_dir, small_text, tmp_path, capsys):
    output = tmp_path / "q"
    args = ["quantize", str(tiny_model_dir), "-o", str(output), "--method", "gptq", "--group-size", "32"]
    args += ["--dataset", str(small_text), "--num-samples", "24", "--seq-len", "32", "--allow-small-calibration"]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert (output / "config.json").is_file() and "windows overlap" in err


def test_recipes_carry_the_force_field_and_leave_it_out_while_false():
    from quantkit.recipes.schema import dump_recipe, recipe_from_text

    base = "model: m\noutput: {directory: out}\n"
    recipe = recipe_from_text(base)
    assert recipe.calibration.allow_small is False
    assert "allow_small" not in dump_recipe(recipe)  # cache keys of existing recipes are unchanged
    forced = recipe_from_text(base + "calibration: {allow_small: true}\n")
    assert forced.calibration.allow_small is True
    assert "allow_small: true" in dump_recipe(forced) and recipe_from_text(dump_recipe(forced)) == forced
    config = CalibrationConfig(**forced.calibration.model_dump())  # as the recipe's calibration stage builds it
    assert config.allow_small is True
