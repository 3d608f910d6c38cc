"""A checkpoint directory written atomically: safetensors shards (and their index) under a temporary
name, config.json, copied tokenizer files, then one rename into place.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from quantkit.atomic import disk_full, publish
from quantkit.errors import QuantkitError
from quantkit.faults import commit_point
from quantkit.format.safetensors_stream import StoredTensor, write_safetensors

SAFETENSORS_METADATA = {"format": "pt"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# --------------------------------------------------------------------------------------------------
# Sharded, atomic writer
# --------------------------------------------------------------------------------------------------


def _shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


class ShardedWriter:
    """Write a checkpoint as safetensors shards into ``<final>.tmp-<pid>``, then rename it into place.

    Use as a context manager: an exception (or leaving without :meth:`finalize`) removes the temp dir.
    """

    def __init__(self, final_dir: Path, max_shard_bytes: int = 2 * 1024**3, overwrite: bool = False) -> None:
        if max_shard_bytes <= 0:
            raise QuantkitError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.final_dir = Path(final_dir)
        self.max_shard_bytes = max_shard_bytes
        self.overwrite = overwrite
        self.tmp_dir = self.final_dir.with_name(f"{self.final_dir.name}.tmp-{os.getpid()}")
        self._check_destination()
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)  # left over by a crashed run with the same pid
        self.tmp_dir.mkdir(parents=True)
        self._pending: dict[str, torch.Tensor | StoredTensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names per flushed shard
        self._names: set[str] = set()
        self._total_bytes = 0
        self._done = False

    def _check_destination(self) -> None:
        if self.final_dir.exists() and not self.overwrite:
            raise QuantkitError(
                f"output directory {self.final_dir} already exists; choose another path or pass overwrite=True"
            )

    def add(self, tensors: Mapping[str, torch.Tensor | StoredTensor]) -> None:
        """Queue tensors; full shards are flushed to disk as they fill. A :class:`StoredTensor` (bytes in another
        safetensors file) is copied when its shard is written and never held in memory."""
        if self._done:
            raise RuntimeError("ShardedWriter.add() after finalize()/abort()")
        for name, tensor in tensors.items():
            if name in self._names:
                raise QuantkitError(f"tensor {name!r} was added twice")
            stored = isinstance(tensor, StoredTensor)
            nbytes = tensor.nbytes if stored else tensor.numel() * tensor.element_size()
            if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
                self._flush()
            self._names.add(name)
            self._pending[name] = tensor if stored else self._owned(tensor)
            self._pending_bytes += nbytes
            self._total_bytes += nbytes

    def _owned(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU tensor that shares no storage with the other queued tensors."""
        t = tensor.detach().to("cpu").contiguous()
        shares = t.untyped_storage().nbytes() != t.numel() * t.element_size()
        if shares or any(
            p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            for p in self._pending.values()
            if isinstance(p, torch.Tensor)
        ):
            t = t.clone()
        return t

    def _flush(self) -> None:
        if not self._pending:
            return
        index = len(self._shards)
        shard = self.tmp_dir / f"shard-{index:05d}.tmp"
        try:
            write_safetensors(shard, self._pending, SAFETENSORS_METADATA)  # save_file's bytes, streamed
        except Exception as exc:
            full = disk_full(exc, self.final_dir)
            if full is None or full is exc:
                raise
            raise full from exc
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finalize(
        self,
        config: Mapping[str, Any],
        copy_files: Sequence[Path] = (),
        quantization_config: Mapping[str, Any] | None = None,
        describe: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write the last shard, index, config.json (plus ``quantization_config`` if given) and copied files; then
        ``describe(staged)`` may add files that read the complete checkpoint in ``staged`` (a run log, a model card)
        before it is renamed into place with them."""
        if self._done:
            raise RuntimeError("ShardedWriter.finalize() called twice or after abort()")
        self._flush()
        if not self._shards:
            raise QuantkitError("nothing to write: no tensors were added")
        self._name_shards()
        cfg = dict(config)
        if quantization_config is not None:
            cfg["quantization_config"] = dict(quantization_config)
        (self.tmp_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for src in copy_files:
            src = Path(src)
            if src.name in ("config.json", SINGLE_FILE, INDEX_FILE) or src.suffix == ".safetensors":
                raise QuantkitError(
                    f"{src.name} would overwrite a checkpoint file; copy tokenizer/generation files only"
                )
            shutil.copy2(src, self.tmp_dir / src.name)
        if describe is not None:
            describe(self.tmp_dir)
        commit_point("checkpoint-staged")
        self._move_into_place()
        self._done = True
        return self.final_dir

    def _name_shards(self) -> None:
        n = len(self._shards)
        if n == 1:
            (self.tmp_dir / "shard-00000.tmp").rename(self.tmp_dir / SINGLE_FILE)
            return
        weight_map: dict[str, str] = {}
        for i, names in enumerate(self._shards):
            final = _shard_name(i + 1, n)
            (self.tmp_dir / f"shard-{i:05d}.tmp").rename(self.tmp_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self._total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.tmp_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    def _move_into_place(self) -> None:
        self._check_destination()
        publish(self.tmp_dir, self.final_dir, overwrite=self.overwrite)

    def abort(self) -> None:
        """Discard everything written so far (the final dir is never touched)."""
        self._done = True
        self._pending = {}
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._done:
            return
        self.abort()
        if exc_type is None:
            raise QuantkitError("ShardedWriter closed without finalize(); nothing was written")
