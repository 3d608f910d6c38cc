"""Rebuild calibration/ from Debian's r-cran-janeaustenr (Jane Austen's six novels, public domain).

Usage: python scripts/build_corpus.py [--deb PATH] [--out calibration]
Without --deb it runs `apt-get download r-cran-janeaustenr` in a temporary directory. The R data is read
with the PyPI package `rdata` (no R needed). Calibration: every chapter of five novels, one JSONL record per
chapter. Evaluation (held out, disjoint): the whole of Persuasion as plain text.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

import rdata

CALIBRATION_BOOKS = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
}
EVALUATION_BOOK = ("persuasion", "Persuasion")
DATA_DIR = "usr/lib/R/site-library/janeaustenr/data"
CHAPTER = re.compile(r"^chapter\s+[\dIVXLC]+\.?$", re.IGNORECASE)


def fetch_deb(workdir: Path) -> Path:
    subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=workdir, check=True)
    return next(workdir.glob("r-cran-janeaustenr_*.deb"))


def read_books(deb: Path, workdir: Path) -> dict[str, list[str]]:
    """Each book as its list of text lines, read from the package's lazy-load R database."""
    subprocess.run(["dpkg-deb", "-x", str(deb), str(workdir / "x")], check=True)
    base = workdir / "x" / DATA_DIR / "Rdata"
    index = rdata.conversion.convert(rdata.parser.parse_file(base.with_suffix(".rdx")))["variables"]
    blob = base.with_suffix(".rdb").read_bytes()
    books = {}
    for name, (offset, length) in index.items():
        chunk = blob[int(offset) : int(offset) + int(length)]
        expected = struct.unpack(">i", chunk[:4])[0]
        raw = zlib.decompress(chunk[4:])
        assert len(raw) == expected, f"{name}: corrupt chunk"
        books[str(name)] = [str(line) for line in rdata.conversion.convert(rdata.parser.parse_data(raw))]
    return books


def paragraphs(lines: list[str]) -> list[str]:
    """Join wrapped lines into paragraphs (blank lines separate them)."""
    out, current = [], []
    for line in [*lines, ""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            out.append(" ".join(current))
            current = []
    return out


def chapters(lines: list[str]) -> list[tuple[str, str]]:
    """(heading, text) per chapter; front matter before the first chapter is dropped."""
    found: list[tuple[str, list[str]]] = []
    for line in lines:
        if CHAPTER.match(line.strip()):
            found.append((line.strip(), []))
        elif found:
            found[-1][1].append(line)
    return [(heading, "\n\n".join(paragraphs(body))) for heading, body in found if paragraphs(body)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deb", type=Path, help="path to r-cran-janeaustenr_*.deb (default: apt-get download)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "calibration")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        deb = args.deb.resolve() if args.deb else fetch_deb(workdir)
        books = read_books(deb, workdir)
    args.out.mkdir(parents=True, exist_ok=True)
    calib = args.out / "austen_calibration.jsonl"
    with calib.open("w", encoding="utf-8") as f:
        for key, title in CALIBRATION_BOOKS.items():
            for heading, text in chapters(books[key]):
                f.write(json.dumps({"text": text, "source": f"{title}, {heading}"}, ensure_ascii=False) + "\n")
    key, title = EVALUATION_BOOK
    evaluation = args.out / "austen_persuasion_eval.txt"
    evaluation.write_text("\n\n".join(paragraphs(books[key])) + "\n", encoding="utf-8")
    for path in (calib, evaluation):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        print(f"{path.name}: {path.stat().st_size / 1e6:.2f} MB sha256:{digest}")


if __name__ == "__main__":
    main()
