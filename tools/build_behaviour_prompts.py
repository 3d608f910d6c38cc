"""Rebuild quantkit/eval/behaviour_prompts.json: the chat prompts of `quantkit eval --behaviour`.

Usage: python -m tools.build_behaviour_prompts [--check]

Every passage is a paragraph of the held-out evaluation text (*Persuasion*, never used for calibration), so the
behaviour check, like perplexity, measures text the quantizer never saw. Four kinds of request, interleaved so that
the first N prompts (``--behaviour-prompts N``) mix all four; passages are taken evenly spaced through the novel
and short (a CPU generates 32 replies in minutes). tests/eval/test_behaviour_prompts.py checks the file equals
this script's output and that no passage occurs in a calibration file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

from quantkit.data.sources import DEFAULT_EVALUATION, SHIPPED_DIR
from quantkit.eval.behaviour import PROMPTS_FILE

# (kind, instruction, passage pool): each kind asks for a short reply a small instruct model can give
KINDS = (
    ("summary", "Summarise this passage in one sentence."),
    ("speaker", "Who is speaking in this passage, and to whom? Answer in one sentence."),
    ("continuation", "Continue the story for two sentences."),
    ("names", "Which people are named in this passage? List their names."),
)
PER_KIND = 8  # 4 kinds x 8 = 32 prompts
NARRATIVE_WORDS = (40, 90)  # a passage long enough to summarise, short enough to keep prompts near 150 tokens
DIALOGUE_WORDS = (25, 80)


def paragraphs(text: str) -> list[str]:
    """The novel's paragraphs after its first chapter heading, whitespace collapsed, headings dropped."""
    found = [" ".join(p.split()) for p in text.split("\n\n")]
    start = next(i for i, p in enumerate(found) if p == "Chapter 1")
    return [p for p in found[start:] if p and not re.fullmatch(r"Chapter \d+", p)]


def _words(passage: str) -> int:
    return len(passage.split())


def _has_dialogue(passage: str) -> bool:
    return passage.count('"') >= 2


def _names(passage: str) -> set[str]:
    """Capitalised words that do not open a sentence: a rough count of the people and places a passage names."""
    sentence_starts = {m.group(1) for m in re.finditer(r'(?:^|[.!?]["\']? +"?)([A-Z][a-z]+)', passage)}
    return {w for w in re.findall(r"\b[A-Z][a-z]{2,}\b", passage) if w not in sentence_starts}


def _complete(passage: str) -> bool:
    """Ends a sentence: a paragraph that leads into a letter or a list ("...from Mary:--") asks too much."""
    return passage.rstrip("\"'")[-1:] in (".", "!", "?")


def _pools(found: list[str]) -> dict[str, list[str]]:
    found = [p for p in found if _complete(p)]
    low, high = NARRATIVE_WORDS
    narrative = [p for p in found if low <= _words(p) <= high and not _has_dialogue(p)]
    low, high = DIALOGUE_WORDS
    dialogue = [p for p in found if low <= _words(p) <= high and _has_dialogue(p)]
    return {
        "summary": narrative,
        "speaker": dialogue,
        "continuation": narrative,
        "names": [p for p in narrative if len(_names(p)) >= 2],
    }


def _evenly(pool: list[str], count: int, used: set[str]) -> list[str]:
    """``count`` passages spread through the novel, none used by an earlier kind."""
    free = [p for p in pool if p not in used]
    if len(free) < count:
        raise SystemExit(f"only {len(free)} unused passages for {count} prompts")
    return [free[int((i + 0.5) * len(free) / count)] for i in range(count)]


def build() -> dict[str, Any]:
    """The prompt file's content, made from the shipped evaluation text alone (same text, same file)."""
    text = DEFAULT_EVALUATION.read_text(encoding="utf-8")
    pools = _pools(paragraphs(text))
    used: set[str] = set()
    chosen: dict[str, list[str]] = {}
    for kind, _ in KINDS:
        chosen[kind] = _evenly(pools[kind], PER_KIND, used)
        used.update(chosen[kind])
    prompts = [
        {"kind": kind, "passage": chosen[kind][i], "prompt": f"{instruction}\n\n{chosen[kind][i]}"}
        for i in range(PER_KIND)
        for kind, instruction in KINDS
    ]
    return {
        "source": str(DEFAULT_EVALUATION.relative_to(SHIPPED_DIR.parent)),
        "source_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "built_by": "python -m tools.build_behaviour_prompts",
        "prompts": prompts,
    }


def render() -> str:
    return json.dumps(build(), indent=1, ensure_ascii=False) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 when the shipped file differs from a rebuild")
    args = parser.parse_args()
    text = render()
    if args.check:
        sys.exit(0 if Path(PROMPTS_FILE).read_text(encoding="utf-8") == text else 1)
    Path(PROMPTS_FILE).write_text(text, encoding="utf-8")
    print(f"wrote {PROMPTS_FILE} ({len(build()['prompts'])} prompts)")


if __name__ == "__main__":
    main()
