"""The resumable state of an interrupted quantization: finished blocks, the next block's input, fingerprints.

Layout of ``<output>.partial/``: ``state.json`` (fingerprints, finished block count, per-layer records),
``block_NNNN.safetensors`` (the checkpoint tensors of each finished block) and ``hidden.pt`` (the input of the
next block, written by ``torch.save`` straight from the tensor's storage, with no in-memory copy). Every file
is written under a temporary name and renamed; ``state.json`` is updated last, so a crash at any point leaves a
consistent state. ``down_inputs.spill`` is the blocks' scratch file (see
:class:`quantkit.quantization.spill.SpillFile`), overwritten by every block and deleted at the end of the run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantkit.errors import QuantkitError
from quantkit.quantization.records import LayerRecord, RunRecord, record_from_dict

STATE = "state.json"
HIDDEN = "hidden.pt"


def partial_dir(output: Path) -> Path:
    return output.with_name(f"{output.name}.partial")


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


class WorkDir:
    def __init__(self, path: Path, state: dict) -> None:
        self.path = path
        self.state = state

    @classmethod
    def open(cls, path: Path, fingerprints: dict[str, str], *, resume: bool) -> WorkDir:
        """Resume a matching interrupted run when ``resume``; otherwise start afresh."""
        state_file = path / STATE
        if resume and state_file.is_file():
            state = json.loads(state_file.read_text())
            for key, value in fingerprints.items():
                if state["fingerprints"].get(key) != value:
                    raise QuantkitError(
                        f"cannot resume from {path}: the {key} differs from the interrupted run's; "
                        "rerun without --resume to start over"
                    )
            return cls(path, state)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        work = cls(path, {"fingerprints": fingerprints, "finished": 0, "records": []})
        work._write_state()
        return work

    @property
    def finished(self) -> int:
        return int(self.state["finished"])

    @property
    def records(self) -> list[RunRecord]:
        """Every record of the finished blocks, in order."""
        return [record_from_dict(r) for r in self.state["records"]]

    @property
    def layer_records(self) -> list[LayerRecord]:
        return [r for r in self.records if isinstance(r, LayerRecord)]

    @property
    def spill_file(self) -> Path:
        return self.path / "down_inputs.spill"

    def block_file(self, index: int) -> Path:
        return self.path / f"block_{index:04d}.safetensors"

    def save_block(
        self, index: int, tensors: dict[str, torch.Tensor], hidden: torch.Tensor | None, records: list[RunRecord]
    ) -> None:
        """Save a finished block and (unless the run needs no activations) the next block's input."""
        assert index == self.finished, f"block {index} saved out of order (expected {self.finished})"
        contiguous = {k: v.contiguous() for k, v in tensors.items()}
        _atomic(self.block_file(index), lambda p: save_file(contiguous, str(p), metadata={"format": "pt"}))
        if hidden is not None:
            _atomic(self.path / HIDDEN, lambda p: torch.save(hidden.contiguous(), p))
        self.state["finished"] = index + 1
        self.state["records"].extend(r.to_dict() for r in records)
        self._write_state()

    def load_hidden(self) -> torch.Tensor:
        return torch.load(self.path / HIDDEN, weights_only=True)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def _write_state(self) -> None:
        _atomic(self.path / STATE, lambda p: p.write_text(json.dumps(self.state, indent=1)))
