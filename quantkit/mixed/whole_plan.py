"""``plan --whole-model --max-size-mb S``: the linears, and the head and the embedding, planned under one budget for
the whole checkpoint.

The head and the embedding enter the exact knapsack as two more units. A scheme the user gives (``--head int8``) is
a unit with one option; ``auto`` offers float ("none") and every scheme ``sensitivity --outer`` measured for it,
whose errors are final-logit KL values, the scale of the linears' kl/hybrid errors. Bits are the source's, as
:func:`quantkit.mixed.whole_model.outer_cost` counts them, plus a bound on the safetensors headers
(:func:`~quantkit.mixed.whole_model.header_bits`), so that the files fit S MB. A head tied to the embedding has no
bits and no choice of its own, and neither may be quantized, unless the run unties it (``--untied-head``, for
``--rotate hadamard``; implied by a measurement taken with ``sensitivity --rotate``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.mixed.measurement import CandidateCost, Measurement
from quantkit.mixed.planner import OuterUnit, Plan, plan
from quantkit.mixed.whole_model import header_bits, outer_cost, outer_tables

AUTO = "auto"


def whole_model_plan(
    measurement: Measurement,
    source: Path,
    max_size_mb: float,
    *,
    head: str = "none",
    embedding: str = "none",
    untied_head: bool = False,
    pins: Sequence[tuple[str, str]] = (),
) -> Plan:
    """The least-error plan whose whole checkpoint (linears, head, embedding, norms, biases) fits ``max_size_mb``;
    ``head`` / ``embedding``: a ``--quantize-head`` spelling, or ``auto`` to choose among the measured ones."""
    head, embedding = head.strip().lower(), embedding.strip().lower()
    untied_head = untied_head or measurement.rotation is not None  # measured rotated: the run unties the head
    auto = [name for name, value in (("head", head), ("embedding", embedding)) if value == AUTO]
    for name in auto:
        if measurement.outer_unit(name) is None:
            raise QuantkitError(
                f"--{name} auto chooses among measured {name} schemes, and the measurement of {measurement.model} has "
                f"none; re-run `quantkit sensitivity {measurement.model} -o MEASUREMENT.json --outer` (hybrid or kl "
                f"mode) or give --{name} a scheme (none, int8, w4g64)"
            )
    tied = outer_cost(measurement, source, untied_head=untied_head).head == "tied"
    if tied and auto:
        raise QuantkitError(
            f"--{auto[0]} auto: {measurement.model} ties its head to the embedding, so neither may be quantized; add "
            "--untied-head (for a run with --rotate hadamard, which unties them) or drop --head/--embedding auto"
        )
    heads = _offered(measurement, "head", head)
    embeddings = _offered(measurement, "embedding", embedding)
    tables = outer_tables(measurement, source, list(heads), list(embeddings), untied_head)
    units = [OuterUnit("head", _options(heads, tables.head), head == AUTO or _measured(heads))] if tables.head else []
    units.append(
        OuterUnit("embedding", _options(embeddings, tables.embedding), embedding == AUTO or _measured(embeddings))
    )
    unties = untied_head and outer_cost(measurement, source).head == "tied"
    rest = tables.rest_bits + header_bits(measurement, source, max_size_mb)  # the files' bytes, not only the tensors'
    return plan(measurement, max_size_mb=max_size_mb, pins=pins, outer_bits=rest, outer=units, untied_head=unties)


def _offered(measurement: Measurement, name: str, value: str) -> dict[str, float | None]:
    """spelling -> measured error (None: not measured) of the schemes the plan may give the head or the embedding."""
    unit = measurement.outer_unit(name)
    if value == AUTO:
        assert unit is not None
        return {spelling: cost.error for spelling, cost in unit.options.items()}
    from quantkit.quantization.methods.head_quant import head_scheme

    head_scheme(value, "rtn")  # an unknown spelling is refused with the list of spellings
    measured = None if unit is None else unit.options.get(value)
    return {value: None if measured is None else measured.error}


def _measured(offered: dict[str, float | None]) -> bool:
    return all(error is not None for error in offered.values())


def _options(offered: dict[str, float | None], bits: dict[str, int]) -> dict[str, CandidateCost]:
    return {spelling: CandidateCost(error or 0.0, bits[spelling]) for spelling, error in offered.items()}
