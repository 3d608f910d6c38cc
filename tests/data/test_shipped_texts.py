"""The shipped evaluation texts are held out: no paragraph of either appears in a shipped calibration file."""

from __future__ import annotations

import json

from quantkit.data.sources import DEFAULT_EVALUATION, OUT_OF_DOMAIN_EVALUATION, SHIPPED_DIR, load_documents

CALIBRATION_FILES = ("austen_calibration.jsonl", "austen_chat.jsonl", "melville_mobydick.jsonl")


def _calibration_text() -> str:
    parts = []
    for name in CALIBRATION_FILES:
        for line in (SHIPPED_DIR / name).read_text(encoding="utf-8").splitlines():
            parts.append(json.dumps(json.loads(line), ensure_ascii=False))  # text and chat records alike
    return "\n".join(parts)


def _long_paragraphs(text: str) -> list[str]:
    # long paragraphs only: short ones ("CHAPTER 1.", "Chapter 3") may legitimately repeat across books
    return [p for p in text.split("\n\n") if len(p) > 200]


def test_evaluation_texts_share_no_paragraph_with_calibration() -> None:
    calibration = _calibration_text()
    for path in (DEFAULT_EVALUATION, OUT_OF_DOMAIN_EVALUATION):
        paragraphs = _long_paragraphs(path.read_text(encoding="utf-8"))
        assert len(paragraphs) > 300, path.name
        shared = [p for p in paragraphs if json.dumps(p, ensure_ascii=False)[1:-1] in calibration]
        assert shared == [], f"{path.name}: {len(shared)} paragraphs also in calibration"


def test_out_of_domain_text_is_the_held_out_moby_dick_chapters() -> None:
    text = OUT_OF_DOMAIN_EVALUATION.read_text(encoding="utf-8")
    assert text.startswith("CHAPTER 101. The Decanter.")
    assert "CHAPTER 135. The Chase.--Third Day." in text
    assert 40_000 < len(text.split()) < 60_000  # about a fifth of the book
    calibration = [json.loads(line)["source"] for line in (SHIPPED_DIR / "melville_mobydick.jsonl").open()]
    assert calibration[-1] == "Moby-Dick, CHAPTER 100. Leg and Arm."
    assert len(load_documents(str(OUT_OF_DOMAIN_EVALUATION)).texts) == 1
