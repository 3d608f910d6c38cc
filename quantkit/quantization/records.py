"""What a quantization run records per linear (and per AWQ decision and tuned block): kept in the work
directory's state.json and in the checkpoint's ``quantkit_log.json``, one JSON object each, typed here."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar


@dataclass(slots=True)
class LayerRecord:
    """How one linear was solved."""

    name: str
    scheme: str
    loss: float | None  # GPTQ objective tr(dW H dW^T); None for round-to-nearest
    damp: float | None
    fell_back_to_rtn: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class AWQScaleRecord:
    """AWQ's scale choice for the linears ``name`` (the previous module) feeds."""

    KIND: ClassVar[str] = "awq-scale"
    name: str
    ratio: float | None  # None: identity scales (plain RTN) won
    rtn_error: float
    awq_error: float

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.KIND} | {
            "ratio": self.ratio,
            "rtn_error": self.rtn_error,
            "awq_error": self.awq_error,
        }


@dataclass(slots=True)
class AWQClipRecord:
    """AWQ's clipping of one linear: the mean fraction of the abs max kept."""

    KIND: ClassVar[str] = "awq-clip"
    name: str
    mean_shrink: float

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.KIND, "mean_shrink": self.mean_shrink}


@dataclass(slots=True)
class TuneRecord:
    """Block-output tuning of one block (``name``: its prefix): mean squared output errors on the calibration
    windows before and after, and whether the tuned weights were kept. No timings: a resumed run's log must
    equal an uninterrupted one's."""

    KIND: ClassVar[str] = "tune"
    name: str
    loss_before: float
    loss_after: float
    steps: int
    kept: bool

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.KIND} | {
            "loss_before": self.loss_before,
            "loss_after": self.loss_after,
            "steps": self.steps,
            "kept": self.kept,
        }


RunRecord = LayerRecord | AWQScaleRecord | AWQClipRecord | TuneRecord
_BY_KIND: dict[str, type[AWQScaleRecord] | type[AWQClipRecord] | type[TuneRecord]] = {
    AWQScaleRecord.KIND: AWQScaleRecord,
    AWQClipRecord.KIND: AWQClipRecord,
    TuneRecord.KIND: TuneRecord,
}


def record_from_dict(data: dict[str, Any]) -> RunRecord:
    """Inverse of ``to_dict``: a record without ``kind`` is a :class:`LayerRecord`."""
    fields = dict(data)
    kind = fields.pop("kind", None)
    return LayerRecord(**fields) if kind is None else _BY_KIND[kind](**fields)
