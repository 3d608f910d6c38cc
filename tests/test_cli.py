import json

from helpers.cli import run_cli

from quantkit import __version__


def test_version_and_help(capsys):
    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0 and __version__ in out
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0 and "calibrate" in out and "eval" in out


def test_calibrate_and_eval_through_the_cli(tiny_model_dir, text_corpus, tmp_path, capsys):
    calib = tmp_path / "calib.safetensors"
    code, out, err = run_cli(
        [
            "calibrate",
            "-m",
            str(tiny_model_dir),
            "--dataset",
            str(text_corpus),
            "--num-samples",
            "4",
            "--seq-len",
            "16",
            "-o",
            str(calib),
        ],
        capsys,
    )
    assert code == 0, err
    assert calib.is_file() and "4 x 16" in out
    report = tmp_path / "eval.json"
    code, out, err = run_cli(
        [
            "eval",
            str(tiny_model_dir),
            "--dataset",
            str(text_corpus),
            "--seq-len",
            "16",
            "--max-windows",
            "3",
            "--json",
            str(report),
        ],
        capsys,
    )
    assert code == 0, err
    data = json.loads(report.read_text())
    assert data["windows"] == 3 and data["tokens"] == 45 and data["perplexity"] > 1


def _fails(args, capsys, expected):
    code, _, err = run_cli(args, capsys)
    assert code == 2, err
    assert expected in " ".join(err.split()), err
    assert "Traceback" not in err


def test_bad_inputs_exit_2_with_one_clear_line(tiny_model_dir, text_corpus, tmp_path, capsys):
    out = tmp_path / "c.safetensors"
    model = ["-m", str(tiny_model_dir)]
    _fails(["calibrate", *model, "--dataset", str(tmp_path / "none.txt"), "-o", str(out)], capsys, "not found")
    (tmp_path / "empty.jsonl").write_text("\n")
    _fails(["calibrate", *model, "--dataset", str(tmp_path / "empty.jsonl"), "-o", str(out)], capsys, "holds no text")
    _fails(
        [
            "calibrate",
            *model,
            "--dataset",
            str(text_corpus),
            "--strategy",
            "document",
            "--seq-len",
            "100000",
            "-o",
            str(out),
        ],
        capsys,
        "no document has 100000 tokens",
    )
    _fails(["calibrate", "-m", "no-such-alias", "-o", str(out)], capsys, "alias (smollm2-135m)")
    _fails(["calibrate", *model, "--dataset", "a:b:c:d", "-o", str(out)], capsys, "bad dataset id 'a:b:c:d'")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    _fails(["eval", str(gpt2)], capsys, "architecture 'gpt2' is not supported")
    assert not out.exists()


def test_a_full_disk_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    import errno

    from quantkit.format import inspect as inspect_module

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "model.safetensors"))

    monkeypatch.setattr(inspect_module, "inspect_checkpoint", full)
    code, _, err = run_cli(["inspect", str(tmp_path)], capsys)
    assert code == 2 and "Traceback" not in err
    assert f"no space left on device writing {tmp_path}/out/model.safetensors; free space and rerun" in err
