"""Progress where stderr is not a terminal (CI logs): plain lines with n/total, elapsed and ETA, at most one
completion line per PLAIN_INTERVAL_S, a repeat after that long without one, the last unit always; a terminal keeps
rich bars. The first-use GGUF conversion reports its steps too."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from helpers.cli import run_cli
from rich.console import Console
from rich.progress import Progress

from quantkit import progress
from quantkit.progress import PlainProgress, format_duration, progress_bar


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(progress, "_clock", fake)
    monkeypatch.setattr(progress, "PLAIN_INTERVAL_S", 10.0)
    return fake


def _lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_durations_read_as_minutes_and_hours():
    assert [format_duration(s) for s in (0, 42.4, 65, 3599, 3725)] == ["0s", "42s", "1m05s", "59m59s", "1h02m"]


def test_a_terminal_gets_rich_bars_and_a_log_gets_plain_lines(monkeypatch):
    monkeypatch.setattr(progress, "console", Console(file=io.StringIO(), force_terminal=True))
    assert isinstance(progress_bar(), Progress)
    monkeypatch.setattr(progress, "console", Console(file=io.StringIO(), force_terminal=False))
    assert isinstance(progress_bar(), PlainProgress)
    assert isinstance(progress_bar(enabled=False), Progress)  # disabled: rich's no-op, as before


def test_plain_lines_carry_count_elapsed_and_eta(clock, capsys):
    bar = PlainProgress()
    task = bar.add_task("Quantizing (gptq)", total=30, unit="block")
    clock.now += 65
    bar.advance(task)  # 1 block in 65 s: 29 left -> 1885 s
    clock.now += 5
    bar.advance(task)  # 5 s after the last line: no line
    clock.now += 6
    bar.beat()  # 11 s without a line: the count again
    clock.now += 1
    bar.advance(task)  # 12 s after the last completion line: a line
    bar.update(task, completed=30)  # the last unit: always a line
    assert _lines(capsys) == [
        "Quantizing (gptq): block 1/30, 1m05s elapsed, ETA 31m25s",
        "Quantizing (gptq): block 2/30, 1m16s elapsed, ETA 17m44s",
        "Quantizing (gptq): block 3/30, 1m17s elapsed, ETA 11m33s",
        "Quantizing (gptq): block 30/30, 1m17s elapsed, done",
    ]


def test_silence_is_broken_during_a_slow_unit_and_fast_units_are_throttled(clock, capsys):
    bar = PlainProgress()
    task = bar.add_task("Evaluating", total=1000)
    for _ in range(6):  # a first unit that takes 30 s: a line every 10 s (the thread beats about every second)
        clock.now += 5
        bar.beat()
    assert _lines(capsys) == [f"Evaluating: 0/1000, {s}s elapsed, ETA ?" for s in (10, 20, 30)]
    for _ in range(999):  # 999 units in 9.99 s: one line (the first), then the last one
        clock.now += 0.01
        bar.advance(task)
    bar.advance(task)
    lines = _lines(capsys)
    assert len(lines) == 2 and lines[0].startswith("Evaluating: 1/1000, 30s elapsed, ETA ")
    assert lines[1] == "Evaluating: 1000/1000, 40s elapsed, done"


def test_a_resumed_run_counts_only_its_own_units_in_the_eta(clock, capsys):
    bar = PlainProgress()
    task = bar.add_task("Quantizing (rtn)", total=30, completed=10, unit="block")
    clock.now += 20
    bar.advance(task)  # 1 block in 20 s (the 10 done before do not count), 19 left
    assert _lines(capsys) == ["Quantizing (rtn): block 11/30, 20s elapsed, ETA 6m20s"]


def test_the_background_thread_prints_during_a_long_unit(monkeypatch, capsys):
    import time

    monkeypatch.setattr(progress, "PLAIN_INTERVAL_S", 0.05)
    with progress_bar() as bar:
        task = bar.add_task("Converting", total=2, unit="step")
        time.sleep(0.5)
        bar.advance(task, 2)
    lines = _lines(capsys)
    assert len(lines) >= 3 and lines[0].startswith("Converting: step 0/2, ") and lines[0].endswith("ETA ?")
    assert lines[-1].startswith("Converting: step 2/2, ") and lines[-1].endswith("done")


@pytest.mark.slow
def test_quantize_in_a_log_prints_block_lines(tiny_model_dir, tiny_calib_file, tmp_path, capsys):
    """`quantkit quantize` with stderr captured (not a terminal): block lines with n/total and ETA, then done."""
    args = ["quantize", str(tiny_model_dir), "-o", str(tmp_path / "out"), "--calib", str(tiny_calib_file)]
    code, _, err = run_cli([*args, "--group-size", "32"], capsys)
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("Quantizing (gptq): block")]
    first = [line for line in lines if line.startswith("Quantizing (gptq): block 1/2, ")]  # the first completion
    duration = r"(\d+s|\d+m\d\ds|\d+h\d\dm)"
    assert re.fullmatch(rf"Quantizing \(gptq\): block 1/2, {duration} elapsed, ETA {duration}", first[0]), lines
    assert lines[-1].startswith("Quantizing (gptq): block 2/2, ") and lines[-1].endswith(" elapsed, done")
    assert all(
        line == lines[-1] or line.startswith(("Quantizing (gptq): block 0/2", "Quantizing (gptq): block 1/2"))
        for line in lines
    )


def test_first_use_conversion_reports_its_steps(tmp_path, monkeypatch, capsys):
    """The GGUF -> HF conversion of an alias (transformers' loaders stubbed with a tiny model): a note, then step
    lines ending in 4/4 done."""
    import transformers
    from helpers.tiny import build_word_tokenizer, tiny_llama

    from quantkit.model import gguf_import

    gguf = tmp_path / "pkg" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_import, "gguf_path", lambda alias: gguf)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: build_word_tokenizer())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny_llama())
    path = gguf_import.ensure_alias("smollm2-135m")
    assert (path / "config.json").is_file() and path == Path(tmp_path / "cache" / "models" / "smollm2-135m")
    lines = _lines(capsys)
    assert lines[0].startswith("smollm2-135m: converting model.gguf into ") and lines[0].endswith("(first use only)")
    steps = [line for line in lines if line.startswith("Converting smollm2-135m (first use): step ")]
    assert steps[0].startswith("Converting smollm2-135m (first use): step 1/4, ") and ", ETA " in steps[0]
    assert steps[-1].startswith("Converting smollm2-135m (first use): step 4/4, ") and steps[-1].endswith("done")
