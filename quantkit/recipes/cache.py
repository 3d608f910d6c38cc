"""Recipe work reused by content hash under ``cache_dir()/recipes``: the keys, and the identities they hash.

Calibration windows are keyed by model identity, source text hash and calibration parameters; sensitivity
measurements by model, calibration, candidates, mode and solver options; evaluations by checkpoint file hash (or
model identity), reference, evaluation text hash and parameters. A checkpoint in ``output.directory`` whose
recorded fingerprints match the run's is reused instead of quantizing again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from quantkit.model.cache import cache_dir

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")


def recipe_cache_root() -> Path:
    return cache_dir() / "recipes"


def content_key(**parts: Any) -> str:
    """A short hash of JSON-able ``parts`` (key order does not matter)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def files_hash(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()[:20]


def checkpoint_hash(directory: Path) -> str:
    """Content hash of a checkpoint: its safetensors shards and config.json."""
    return files_hash([*sorted(directory.glob("*.safetensors")), directory / "config.json"])


def model_identity(path: Path) -> str:
    """The weights' fingerprint plus the tokenizer files: what calibration and evaluation depend on."""
    from quantkit.model.source_weights import SourceWeights

    tokenizer = [path / name for name in _TOKENIZER_FILES if (path / name).is_file()]
    return content_key(weights=SourceWeights(path).fingerprint(), tokenizer=files_hash(tokenizer))
