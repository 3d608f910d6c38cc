"""The shipped behaviour prompts: rebuilt by tools/build_behaviour_prompts.py to the same file, every passage taken
from the held-out evaluation text and from no calibration text, and shipped in the package."""

from __future__ import annotations

import json
import re

from helpers.paths import REPO

from quantkit.data.sources import DEFAULT_CALIBRATION, DEFAULT_EVALUATION, SHIPPED_DIR
from quantkit.eval.behaviour import DEFAULT_BEHAVIOUR_PROMPTS, PROMPTS_FILE, shipped_prompts
from tools.build_behaviour_prompts import KINDS, render

SHIPPED = json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))


def _collapsed(text: str) -> str:
    return " ".join(text.split())


def test_the_file_is_the_builders_output() -> None:
    assert PROMPTS_FILE.read_text(encoding="utf-8") == render()


def test_32_prompts_of_four_kinds_interleaved() -> None:
    prompts = SHIPPED["prompts"]
    assert len(prompts) == DEFAULT_BEHAVIOUR_PROMPTS == len(shipped_prompts())
    kinds = [kind for kind, _ in KINDS]
    assert [p["kind"] for p in prompts[:4]] == kinds and [p["kind"] for p in prompts[-4:]] == kinds
    assert len({p["passage"] for p in prompts}) == len(prompts)  # no passage asked about twice
    assert shipped_prompts(5) == [p["prompt"] for p in prompts[:5]]


def test_every_passage_is_held_out_text_and_in_no_calibration_file() -> None:
    evaluation = _collapsed(DEFAULT_EVALUATION.read_text(encoding="utf-8"))
    calibration = [_collapsed(path.read_text(encoding="utf-8")) for path in sorted(SHIPPED_DIR.glob("*.jsonl"))]
    assert DEFAULT_CALIBRATION.name in {path.name for path in SHIPPED_DIR.glob("*.jsonl")}
    for prompt in SHIPPED["prompts"]:
        passage = prompt["passage"]
        assert passage in evaluation and prompt["prompt"].endswith(passage)
        assert 25 <= len(passage.split()) <= 90
        assert not any(passage[:80] in text for text in calibration), passage[:80]


def test_the_prompts_ship_in_the_package() -> None:
    section = (REPO / "pyproject.toml").read_text().split("[tool.setuptools.package-data]", 1)[1]
    listed = re.search(r"^quantkit = \[(.*?)\]", section, flags=re.M)
    assert listed is not None and f'"{PROMPTS_FILE.relative_to(REPO / "quantkit")}"' in listed.group(1)
