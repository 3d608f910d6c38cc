"""Rebuild calibration/ from Debian packages of public-domain novels (no R needed).

Usage: python -m tools.build_corpus [--debs DIR] [--out calibration]

Sources (each a Debian package, fetched with `apt-get download` into a temporary directory unless --debs names a
directory holding the .deb files; the R data is read with the PyPI package `rdata`):
- r-cran-janeaustenr: Jane Austen's six novels.
  - `austen_calibration.jsonl`: every chapter of five novels, one JSON record per chapter (the default
    calibration set).
  - `austen_persuasion_eval.txt`: the whole of *Persuasion* as plain text (held out: the default evaluation text).
  - `austen_chat.jsonl`: *Pride and Prejudice* as chat records, per chapter a user turn asking to continue its
    first paragraph and the rest of the chapter as the assistant's answer (calibration in chat format).
- r-cran-tokenizers: Herman Melville's *Moby-Dick*, the Project Gutenberg header and licence dropped:
  - `melville_mobydick.jsonl`: chapters 1-100, one record per chapter: calibration text from another author and
    century;
  - `melville_mobydick_eval.txt`: chapters 101-135 as plain text (held out: the out-of-domain evaluation text, for
    models calibrated on Austen as users calibrate on their own data).
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
CHAT_BOOK = ("prideprejudice", "Pride and Prejudice")
AUSTEN_PACKAGE = "r-cran-janeaustenr"
MELVILLE_PACKAGE = "r-cran-tokenizers"
CHAPTER = re.compile(r"^chapter\s+[\dIVXLC]+\.?$", re.IGNORECASE)
MELVILLE_CHAPTER = re.compile(r"^CHAPTER \d+\. .*$")
MELVILLE_HELD_OUT_FROM = 101  # chapters from this one on are the out-of-domain evaluation text
GUTENBERG_END = re.compile(r"^(End of Project Gutenberg|\*\*\* END OF THIS PROJECT GUTENBERG)", re.MULTILINE)


def fetch_deb(package: str, debs: Path) -> Path:
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        subprocess.run(["apt-get", "download", package], cwd=debs, check=True)
        found = sorted(debs.glob(f"{package}_*.deb"))
    return found[-1]


def read_r_data(deb: Path, workdir: Path) -> dict[str, list[str]]:
    """Every object of the package's lazy-load R data base, as a list of strings."""
    target = workdir / deb.stem
    subprocess.run(["dpkg-deb", "-x", str(deb), str(target)], check=True)
    base = next(target.glob("usr/lib/R/site-library/*/data/Rdata.rdx")).with_suffix("")
    index = rdata.conversion.convert(rdata.parser.parse_file(base.with_suffix(".rdx")))["variables"]
    blob = base.with_suffix(".rdb").read_bytes()
    objects = {}
    for name, (offset, length) in index.items():
        chunk = blob[int(offset) : int(offset) + int(length)]
        expected = struct.unpack(">i", chunk[:4])[0]
        raw = zlib.decompress(chunk[4:])
        assert len(raw) == expected, f"{name}: corrupt chunk"
        objects[str(name)] = [str(line) for line in rdata.conversion.convert(rdata.parser.parse_data(raw))]
    return objects


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


def chapters(lines: list[str], heading: re.Pattern[str] = CHAPTER) -> list[tuple[str, list[str]]]:
    """(heading, paragraphs) per chapter; front matter before the first chapter is dropped."""
    found: list[tuple[str, list[str]]] = []
    for line in lines:
        if heading.match(line.strip()):
            found.append((line.strip(), []))
        elif found:
            found[-1][1].append(line)
    return [(title, paragraphs(body)) for title, body in found if paragraphs(body)]


def write_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def chat_records(lines: list[str], title: str) -> list[dict]:
    records = []
    for heading, paras in chapters(lines):
        if len(paras) < 2:
            continue
        ask = f"Continue this passage from {title}, in the same style:\n\n{paras[0]}"
        messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": "\n\n".join(paras[1:])}]
        records.append({"messages": messages, "source": f"{title}, {heading}"})
    return records


def melville_lines(text: str) -> list[str]:
    body = GUTENBERG_END.split(text.replace("\r", ""), maxsplit=1)[0]
    return body.split("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debs", type=Path, help="directory holding the .deb files (default: apt-get download)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "calibration")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        debs = args.debs.resolve() if args.debs else workdir
        books = read_r_data(fetch_deb(AUSTEN_PACKAGE, debs), workdir)
        (mobydick,) = read_r_data(fetch_deb(MELVILLE_PACKAGE, debs), workdir)["mobydick"]
    args.out.mkdir(parents=True, exist_ok=True)
    melville = chapters(melville_lines(mobydick), MELVILLE_CHAPTER)
    outputs = {
        "austen_calibration.jsonl": [
            {"text": "\n\n".join(paras), "source": f"{title}, {heading}"}
            for key, title in CALIBRATION_BOOKS.items()
            for heading, paras in chapters(books[key])
        ],
        "austen_chat.jsonl": chat_records(books[CHAT_BOOK[0]], CHAT_BOOK[1]),
        "melville_mobydick.jsonl": [
            {"text": "\n\n".join(paras), "source": f"Moby-Dick, {heading}"}
            for heading, paras in melville[: MELVILLE_HELD_OUT_FROM - 1]
        ],
    }
    for name, records in outputs.items():
        write_jsonl(args.out / name, records)
    key, _ = EVALUATION_BOOK
    (args.out / "austen_persuasion_eval.txt").write_text("\n\n".join(paragraphs(books[key])) + "\n", encoding="utf-8")
    held_out = [text for heading, paras in melville[MELVILLE_HELD_OUT_FROM - 1 :] for text in (heading, *paras)]
    (args.out / "melville_mobydick_eval.txt").write_text("\n\n".join(held_out) + "\n", encoding="utf-8")
    for name in [*outputs, "austen_persuasion_eval.txt", "melville_mobydick_eval.txt"]:
        path = args.out / name
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        print(f"{path.name}: {path.stat().st_size / 1e6:.2f} MB sha256:{digest}")


if __name__ == "__main__":
    main()
