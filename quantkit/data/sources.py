"""Read text documents from local files (.txt, .jsonl, .json, .parquet), directories, or HF datasets."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.errors import CalibrationError

LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "calibration"
DEFAULT_CALIBRATION = SHIPPED_DIR / "austen_calibration.jsonl"
DEFAULT_EVALUATION = SHIPPED_DIR / "austen_persuasion_eval.txt"
# another author and era than the default calibration text: how quality holds outside the calibration domain
OUT_OF_DOMAIN_EVALUATION = SHIPPED_DIR / "melville_mobydick_eval.txt"

ChatRenderer = Callable[[list[dict[str, Any]]], str]


@dataclass(slots=True)
class Documents:
    texts: list[str]
    source: str
    content_hash: str  # sha256 over the documents, in order

    def __len__(self) -> int:
        return len(self.texts)


def content_hash(texts: Iterable[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def load_documents(
    source: str | Path | None, *, text_column: str = "text", render_chat: ChatRenderer | None = None
) -> Documents:
    """Documents from ``source``: a local file or directory, or an HF dataset ``name[:config][:split]``."""
    label = None
    if source is None:
        source, label = DEFAULT_CALIBRATION, f"shipped:{DEFAULT_CALIBRATION.name}"
    text = str(source)
    path = Path(text).expanduser()
    if path.exists():
        texts = _read_local(path, text_column, render_chat)
    elif path.suffix in LOCAL_SUFFIXES or text.startswith((".", "/", "~")):
        raise CalibrationError(f"dataset file '{text}' not found; check the path")
    else:
        texts = _read_hub(text, text_column, render_chat)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise CalibrationError(f"dataset '{text}' holds no text; point --dataset at a file with non-empty text")
    return Documents(texts=texts, source=label or text, content_hash=content_hash(texts))


def _read_local(path: Path, column: str, render_chat: ChatRenderer | None) -> list[str]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOCAL_SUFFIXES)
        if not files:
            raise CalibrationError(f"directory '{path}' has no {'/'.join(LOCAL_SUFFIXES)} files")
        return [t for f in files for t in _read_file(f, column, render_chat)]
    if path.suffix not in LOCAL_SUFFIXES:
        raise CalibrationError(f"'{path}' has an unsupported format; use one of {', '.join(LOCAL_SUFFIXES)}")
    return _read_file(path, column, render_chat)


def _read_file(path: Path, column: str, render_chat: ChatRenderer | None) -> list[str]:
    try:
        if path.suffix == ".txt":
            return [path.read_text(encoding="utf-8")]
        if path.suffix == ".parquet":
            return _records_to_texts(_read_parquet(path), column, render_chat, path)
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"cannot read '{path}': {exc}") from exc
    if path.suffix == ".jsonl":
        records = []
        for lineno, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise CalibrationError(f"{path}:{lineno}: invalid JSON ({exc.msg}); fix that line") from exc
        return _records_to_texts(records, column, render_chat, path)
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{path}: invalid JSON at line {exc.lineno} ({exc.msg})") from exc
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise CalibrationError(f"{path}: expected a JSON list of records or strings (or {{'data': [...]}})")
    return _records_to_texts(data, column, render_chat, path)


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise CalibrationError(f"cannot read parquet file '{path}': {exc}") from exc


def _records_to_texts(
    records: list[Any], column: str, render_chat: ChatRenderer | None, origin: Path | str
) -> list[str]:
    texts = []
    for i, record in enumerate(records):
        if isinstance(record, str):
            texts.append(record)
        elif isinstance(record, dict) and isinstance(record.get(column), str):
            texts.append(record[column])
        elif isinstance(record, dict) and isinstance(record.get("messages"), list):
            if render_chat is None:
                raise CalibrationError(
                    f"{origin}: record {i} has 'messages' but no tokenizer chat template is available"
                )
            texts.append(render_chat(record["messages"]))
        else:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise CalibrationError(
                f"{origin}: record {i} has no text field '{column}' (found {keys}); "
                "pass --text-column with the right field name"
            )
    return texts


def parse_hub_spec(spec: str) -> tuple[str, str | None, str]:
    """``name[:config][:split]`` -> (name, config, split); split defaults to train."""
    parts = spec.split(":")
    if len(parts) > 3 or any(not p for p in parts):
        raise CalibrationError(
            f"bad dataset id '{spec}'; use name, name:config or name:config:split "
            "(e.g. wikitext:wikitext-2-raw-v1:test)"
        )
    name = parts[0]
    config = parts[1] if len(parts) > 1 else None
    split = parts[2] if len(parts) > 2 else "train"
    return name, config, split


def _read_hub(spec: str, column: str, render_chat: ChatRenderer | None) -> list[str]:
    name, config, split = parse_hub_spec(spec)
    import datasets

    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # offline, unknown dataset, bad config/split
        raise CalibrationError(
            f"could not load dataset '{spec}' from the Hugging Face Hub ({type(exc).__name__}: {exc}); "
            "check name:config:split, or pass a local .txt/.jsonl/.json/.parquet file or directory"
        ) from exc
    if column not in dataset.column_names and "messages" not in dataset.column_names:
        raise CalibrationError(
            f"dataset '{spec}' has no column '{column}' (columns: {dataset.column_names}); pass --text-column"
        )
    return _records_to_texts(list(dataset), column, render_chat, spec)
