"""docs/benchmarks.md, rendered from the tables the benchmarks recorded (benchmarks/results/*.json; see
benchmarks/record.py). Run after a benchmark records a table: ``python -m benchmarks.render``; a test checks the
page equals its rendering, so the page never drifts from the recorded figures."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.record import load_tables

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "benchmarks.md"
README = REPO / "README.md"
# README.md carries the comparison table too, between these markers, rendered from the same record
README_TABLE = ("llm_compressor", "<!-- llm-compressor:start -->", "<!-- llm-compressor:end -->")
HEADER = """\
# Benchmarks

This page is rendered from the tables the benchmarks recorded (`benchmarks/results/*.json`, written by
`python -m benchmarks.<name> ... --record <table>`; `python -m benchmarks.render` writes this page). Each table
states its command, its protocol, its baseline and the machine it ran on; compare rows within a table, not across
tables. The default model is SmolLM2-135M-Instruct, whose weights are themselves dequantized Q4_1 values (it ships
as a GGUF): 4-bit schemes start from weights that already lie near a 4-bit grid, so expect larger losses on models
trained in 16 bits. Perplexity is measured on held-out *Persuasion* (never used for calibration).

## Reading the columns

| column | meaning |
|---|---|
| ppl, ppl +% | perplexity on the held-out text, and its change against the original model's |
| KL mean, p99 | KL divergence of the next-token distribution from the original's: mean over tokens, 99th percentile |
| top-1 | share of tokens where both models rank the same token first |
| bits/w | every stored bit (codes, scales, zero points, float layers, embeddings, a head) over the parameter count |
| size | the checkpoint's safetensors bytes, in MB (10^6 bytes) |
"""


def render_table(table: dict[str, Any]) -> str:
    lines = [f"## {table['title']}", "", f"`{table['command']}`", ""]
    measured = f"Measured {table['measured']} on a {table['machine']}."
    lines += [f"{table['protocol']} Baseline: {table['baseline']}. {measured}", ""]
    lines += ["| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in table["rows"]]
    if table["notes"]:
        lines += ["", *(f"- {note}" for note in table["notes"])]
    return "\n".join(lines) + "\n"


def render(directory: Path | None = None) -> str:
    tables = load_tables(directory) if directory is not None else load_tables()
    return HEADER + "".join("\n" + render_table(t) for t in tables)


def render_readme(readme: str, directory: Path | None = None) -> str:
    """``readme`` with the comparison table between its markers rendered from its record (rows and columns only)."""
    name, start, end = README_TABLE
    table = next(t for t in (load_tables(directory) if directory else load_tables()) if t["name"] == name)
    rows = ["| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
    rows += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in table["rows"]]
    head, _, rest = readme.partition(start)
    _, _, tail = rest.partition(end)
    return head + start + "\n" + "\n".join(rows) + "\n" + end + tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from its rendering")
    args = parser.parse_args()
    text, readme = render(), render_readme(README.read_text())
    if args.check:
        raise SystemExit(0 if PAGE.read_text() == text and README.read_text() == readme else 1)
    PAGE.write_text(text)
    README.write_text(readme)
    print(f"wrote {PAGE} and the table in {README}")


if __name__ == "__main__":
    main()
