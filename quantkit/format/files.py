"""The files of a checkpoint directory: config.json, the safetensors shards (single file or index), and
the stored dtype of every scale (read from the safetensors headers, without loading tensors).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from quantkit.atomic import inside
from quantkit.errors import QuantkitError
from quantkit.format.tensors import SCALE
from quantkit.format.writer import INDEX_FILE, SINGLE_FILE

RUN_LOG = "quantkit_log.json"  # what `quantkit quantize` records beside the checkpoint (method, data, layers)
MODEL_CARD = "README.md"  # the card quantize writes; the float model's own card describes another model
_NOT_SIDE_FILES = {"config.json", INDEX_FILE, RUN_LOG, MODEL_CARD, "quantize_config.json"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def side_files(path: Path) -> list[Path]:
    """A model directory's tokenizer, generation config, chat template and other side files: what a checkpoint
    written from it copies (not its weights, configs, or quantkit's run log). A side file that is a link must
    point inside the model (:func:`_link_root`), so a crafted model cannot have a checkpoint carry another file
    of this machine."""
    files = [
        f
        for f in sorted(Path(path).iterdir())
        if f.is_file()
        and f.name not in _NOT_SIDE_FILES
        and not f.name.startswith(".")
        and not f.name.endswith(_WEIGHT_SUFFIXES)
    ]
    root = _link_root(Path(path))
    for f in files:
        if f.is_symlink() and not f.resolve().is_relative_to(root):
            raise QuantkitError(
                f"{f} is a link to {f.resolve()}, outside the model {root}; replace the link with the file itself"
            )
    return files


def _link_root(path: Path) -> Path:
    """Where a model directory's links may point: the directory, or for a Hugging Face cache snapshot
    (``models--org--name/snapshots/<revision>/``) the repository folder whose ``blobs/`` its links name."""
    resolved = path.resolve()
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith("models--"):
        return resolved.parent.parent
    return resolved


def read_checkpoint_config(path: Path) -> dict:
    """The parsed config.json of a checkpoint directory."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise QuantkitError(f"{path} has no config.json; point to a checkpoint directory")
    return json.loads(config_path.read_text())


def read_run_log(path: Path) -> dict[str, Any]:
    """The parsed run log of a checkpoint directory; {} when there is none or it is not a JSON object."""
    log = Path(path) / RUN_LOG
    try:
        data = json.loads(log.read_text()) if log.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def is_quantized_checkpoint(path: Path) -> bool:
    """True when ``path`` holds a config.json with a compressed-tensors quantization_config."""
    try:
        cfg = read_checkpoint_config(Path(path))
    except (QuantkitError, json.JSONDecodeError, OSError):
        return False
    qc = cfg.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors"


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint (single file or index)."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        files = [inside(path, f, f"{INDEX_FILE}'s shard") for f in sorted(set(weight_map.values()))]
    elif (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    else:
        raise QuantkitError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    for f in files:
        if not f.is_file():
            raise QuantkitError(f"shard {f.name} listed in {INDEX_FILE} is missing from {path}")
    return files


def scale_dtypes(files: Iterable[Path]) -> dict[str, torch.dtype]:
    """The stored dtype of every scale tensor (``weight_scale``, a KV cache's ``k_scale`` / ``v_scale``), read from
    the safetensors headers."""
    from safetensors import safe_open

    dtypes: dict[str, torch.dtype] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.endswith(("." + SCALE, ".k_scale", ".v_scale")):
                    dtypes[key] = handle.get_slice(key).get_dtype()
    return {k: _DTYPES.get(v, torch.bfloat16) for k, v in dtypes.items()}


_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "U8": torch.uint8,
}
