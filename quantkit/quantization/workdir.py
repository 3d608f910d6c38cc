"""The resumable state of an interrupted quantization: finished blocks, the next block's input, fingerprints.

Layout of ``<output>.partial/``: ``state.json`` (fingerprints, finished block count, the name of the next block's
input, per-layer records), ``block_NNNN.safetensors`` (the checkpoint tensors of each finished block) and
``hidden_NNNN.pt`` (the input of block NNNN, written by ``torch.save`` straight from the tensor's storage) and, with
a rotation, ``outer.safetensors`` (the rotated tensors outside the blocks, written before the first block).

Every state change is one atomic, durable step: a file is written under a temporary name, flushed, renamed and
its directory flushed; a block's tensors and its input for the next block get new names, and ``state.json``,
renamed last, is what makes them current. A kill at any instruction leaves the old state or the new one, and
files the current state does not name are removed when the run is resumed. ``down_inputs.spill`` is the blocks'
scratch file (see :class:`quantkit.quantization.spill.SpillFile`), ``hessian.spill`` the solver's (a stage's
Hessian parked while GPTQ holds its factor). Removal after success first renames the
directory away (one atomic step), so a crash while deleting leaves nothing a later run could mistake for work.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from quantkit.atomic import inside, write_atomically, write_text
from quantkit.errors import QuantkitError
from quantkit.faults import commit_point
from quantkit.quantization.memory_strategy import MemoryStrategy
from quantkit.quantization.methods.records import LayerRecord, RunRecord, record_from_dict
from quantkit.quantization.spill import SpillFile

STATE = "state.json"
LEGACY_HIDDEN = "hidden.pt"  # the one input file of work directories written before per-block names
SPILL = "down_inputs.spill"
HESSIAN_SCRATCH = "hessian.spill"
OUTER = "outer.safetensors"


def partial_dir(output: Path) -> Path:
    return output.with_name(f"{output.name}.partial")


def retired_name(path: Path) -> Path:
    """Where a work directory goes to be deleted (a name no run resumes from)."""
    return path.with_name(f".{path.name}.retired-{os.getpid()}")


class WorkDir:
    def __init__(self, path: Path, state: dict) -> None:
        self.path = path
        self.state = state

    @classmethod
    def open(cls, path: Path, fingerprints: dict[str, str], *, resume: bool, discard: bool) -> WorkDir:
        """Resume a matching interrupted run when ``resume``; start afresh when there is none. An interrupted run
        is discarded only when ``discard`` (``--force``); otherwise it is an error that says how to go on."""
        state_file = path / STATE
        if state_file.is_file():
            state = json.loads(state_file.read_text())
            if resume:
                _check_fingerprints(path, state["fingerprints"], fingerprints)
                work = cls(path, state)
                work._remove_unreferenced()
                return work
            if not discard:
                raise QuantkitError(
                    f"{path} holds an interrupted run ({state['finished']} blocks done); pass --resume to continue "
                    "it, or --force to discard it and start over"
                )
        shutil.rmtree(path, ignore_errors=True)  # discarded, or never got a state (killed while being created)
        path.mkdir(parents=True)
        work = cls(path, {"fingerprints": fingerprints, "finished": 0, "hidden": None, "records": []})
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
        return self.path / SPILL

    @property
    def hessian_scratch(self) -> Path:
        """Where the solver parks a stage's Hessian while it holds the factor (scratch, like the spill file)."""
        return self.path / HESSIAN_SCRATCH

    def memory_strategy(self, device: torch.device, spill: SpillFile) -> MemoryStrategy:
        """The spill and scratch files spare CPU memory; on an accelerator the activations stay in device memory."""
        if device.type != "cpu":
            return MemoryStrategy()
        return MemoryStrategy(spill=spill, hessian_file=self.hessian_scratch)

    def block_file(self, index: int) -> Path:
        return self.path / f"block_{index:04d}.safetensors"

    def save_block(
        self,
        index: int,
        tensors: dict[str, torch.Tensor],
        hidden: torch.Tensor | None,
        records: list[RunRecord],
        reference: torch.Tensor | None = None,
    ) -> None:
        """Save a finished block and (unless the run needs no activations) the next block's input, and with
        tuning the float model's input to it (``reference``); the state that names them is written last."""
        assert index == self.finished, f"block {index} saved out of order (expected {self.finished})"
        contiguous = {k: v.contiguous() for k, v in tensors.items()}
        write_atomically(self.block_file(index), lambda p: save_file(contiguous, str(p), metadata={"format": "pt"}))
        commit_point("block-written")
        previous = [self._hidden_path(), self._reference_path()]
        name = reference_name = None
        if hidden is not None:
            name = f"hidden_{index + 1:04d}.pt"
            write_atomically(self.path / name, lambda p: torch.save(hidden.cpu().contiguous(), p))
            commit_point("hidden-written")
        if reference is not None:
            reference_name = f"reference_{index + 1:04d}.pt"
            write_atomically(self.path / reference_name, lambda p: torch.save(reference.cpu().contiguous(), p))
            commit_point("reference-written")
        self.state["finished"] = index + 1
        self.state["hidden"] = name
        if reference_name is not None:
            self.state["reference"] = reference_name
        self.state["records"].extend(r.to_dict() for r in records)
        self._write_state()
        commit_point("state-written")
        for old in previous:
            if old is not None and old.name not in (name, reference_name):
                old.unlink(missing_ok=True)

    @property
    def has_outer(self) -> bool:
        return bool(self.state.get("outer"))

    def save_outer(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep the tensors outside the blocks (rotated once, at the start); the state names them last."""
        contiguous = {k: v.contiguous() for k, v in tensors.items()}
        write_atomically(self.path / OUTER, lambda p: save_file(contiguous, str(p), metadata={"format": "pt"}))
        self.state["outer"] = OUTER
        self._write_state()
        commit_point("outer-written")

    def load_outer(self) -> dict[str, torch.Tensor]:
        return load_file(str(inside(self.path, self.state["outer"]))) if self.has_outer else {}

    def load_hidden(self, device: torch.device | None = None) -> torch.Tensor:
        """The next block's input (saved from the CPU), onto ``device`` (None: the CPU)."""
        path = self._hidden_path()
        if path is None or not path.is_file():
            raise QuantkitError(f"{self.path} has no input for block {self.finished}; rerun without --resume")
        return torch.load(path, weights_only=True).to(device)

    def load_reference(self, device: torch.device | None = None) -> torch.Tensor | None:
        """The float model's input to the next block (tuning runs; None when this run keeps none), onto ``device``."""
        path = self._reference_path()
        if path is None:
            return None
        if not path.is_file():
            raise QuantkitError(f"{self.path} has no reference input for block {self.finished}; rerun without --resume")
        return torch.load(path, weights_only=True).to(device)

    def retire(self) -> Path:
        """Rename the directory away (one atomic step) so that nothing can resume from it; returns the new path."""
        retired = retired_name(self.path)
        self.path.rename(retired)
        commit_point("work-dir-retired")
        return retired

    def _hidden_path(self) -> Path | None:
        name = self.state.get("hidden", LEGACY_HIDDEN)
        return inside(self.path, name, "state.json's input") if name else None

    def _reference_path(self) -> Path | None:
        name = self.state.get("reference")
        return inside(self.path, name, "state.json's reference") if name else None

    def _remove_unreferenced(self) -> None:
        """Files of steps that never committed: temporaries, blocks past ``finished``, superseded inputs."""
        keep = {STATE, SPILL, HESSIAN_SCRATCH, *(self.block_file(i).name for i in range(self.finished))}
        if self.has_outer:
            keep.add(OUTER)
        for current in (self._hidden_path(), self._reference_path()):
            if current is not None:
                keep.add(current.name)
        for file in self.path.iterdir():
            if file.name not in keep:
                file.unlink(missing_ok=True)

    def _write_state(self) -> None:
        write_text(self.path / STATE, json.dumps(self.state, indent=1))


_FIELDS = {"scheme": "method, scheme or solver options", "model": "model weights"}  # fingerprint -> what it covers


def _check_fingerprints(path: Path, recorded: dict[str, str], current: dict[str, str]) -> None:
    """A mismatch names the field that differs; the solve settings are checked first (they say the most)."""
    for key in sorted(current, key=lambda k: k != "scheme"):
        if recorded.get(key) != current[key]:
            raise QuantkitError(
                f"cannot resume from {path}: the {_FIELDS.get(key, key)} differ from the interrupted run's; resume "
                "with the same options and data, or pass --force (without --resume) to discard it and start over"
            )
