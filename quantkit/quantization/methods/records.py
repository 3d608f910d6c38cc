"""What a quantization run records: one :class:`LayerRecord` per solved linear, plus the records of the algorithms
that decide more (AWQ's scales, a tuned block), each typed in its algorithm's module and listed in its
capabilities. Kept in the work directory's state.json and the checkpoint's ``quantkit_log.json``, one JSON object
each."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

from quantkit.quantization.methods import registry


class RunRecord(Protocol):
    """A record of an algorithm's own: a ``KIND`` tag, built back from its ``to_dict()`` by keyword."""

    KIND: str

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(slots=True)
class LayerRecord:
    """How one linear was solved."""

    name: str
    scheme: str
    loss: float | None  # GPTQ objective tr(dW H dW^T); None for round-to-nearest
    damp: float | None
    fell_back_to_rtn: bool = False
    routed_tokens: int | None = None  # a routed expert's linear: calibration tokens the router sent to its expert

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.routed_tokens is None:  # a dense linear's record stays as it always was
            del data["routed_tokens"]
        return data


def kind_dict(record: Any) -> dict[str, Any]:
    """A kind-tagged record as JSON-able data: its name, its kind, then its other fields in order."""
    fields = asdict(record)
    return {"name": fields.pop("name"), "kind": record.KIND} | fields


def record_from_dict(data: dict[str, Any]) -> LayerRecord | RunRecord:
    """Inverse of ``to_dict``: a record without ``kind`` is a :class:`LayerRecord`, else the registered record
    type of that kind."""
    fields = dict(data)
    kind = fields.pop("kind", None)
    if kind is None:
        return LayerRecord(**fields)
    for algorithm in registry.algorithms():
        for record in algorithm.caps.records:
            if getattr(record, "KIND", None) == kind:
                return record(**fields)
    raise ValueError(f"unknown record kind {kind!r}")
