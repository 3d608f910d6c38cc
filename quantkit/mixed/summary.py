"""A measurement summed up per candidate, robust to outlier units: medians, means without the outliers, and the
outliers named.

Unit errors span decades (and proxy errors are not comparable across layers), so one unit can outweigh all the
others: a sum or a plain mean then shows whatever that unit says, e.g. g32 worse than g128 because a single
down_proj's solver happened to do better with bigger groups. Per candidate the summary gives the median error
over the units measured with it, and the mean over the units that are not outliers. A unit is an outlier when,
under some quantized candidate, its error is at least ``OUTLIER_FACTOR`` times that candidate's median unit error
and its robust z-score (on log10 errors: 0.6745 x distance from the median / median absolute deviation) exceeds
``OUTLIER_Z``. Outliers are excluded from every candidate's mean (so the means cover the same units) and named.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quantkit.mixed.candidates import FP16
from quantkit.mixed.measurement import Measurement, UnitMeasurement

if TYPE_CHECKING:
    from rich.table import Table

OUTLIER_FACTOR = 10.0  # an outlier's error is at least this multiple of the median unit's
OUTLIER_Z = 3.5  # and its robust z-score of log10(error) exceeds this (Iglewicz and Hoaglin)
ERROR_UNITS = {"proxy": "Hessian-weighted squared error", "kl": "KL, nats", "hybrid": "KL, nats"}


@dataclass(slots=True)
class CandidateSummary:
    name: str
    units: int  # units measured with this candidate (a layout no engine loads is not measured)
    bits_per_weight: float | None = None  # over those units
    median_error: float | None = None  # over those units
    mean_error: float | None = None  # over those units that are not outliers
    worst_unit: str = ""  # the unit with the largest error, outliers included ("" when every error is 0)


@dataclass(slots=True)
class SensitivitySummary:
    mode: str
    total_units: int
    candidates: list[CandidateSummary] = field(default_factory=list)
    outliers: list[str] = field(default_factory=list)  # unit names, measurement order

    def caption(self) -> str:
        """Which statistic is which, and the outliers by name (with what was done with them)."""
        units = ERROR_UNITS.get(self.mode, "error")
        text = f"errors in {units}; median over the units measured with each candidate"
        if not self.outliers:
            return f"{text}; mean over the same units (no outlier units)"
        names = ", ".join(short_unit_name(name) for name in self.outliers)
        verb = "is an outlier" if len(self.outliers) == 1 else "are outliers"
        return f"{text}; {names} {verb} (error >= {OUTLIER_FACTOR:g}x the median unit's): excluded from the means"


def short_unit_name(name: str) -> str:
    """``model.layers.3.mlp.down_proj`` -> ``layers.3.mlp.down_proj`` (the part that tells units apart)."""
    return name.removeprefix("model.")


def outlier_units(measurement: Measurement) -> list[str]:
    """Units whose error under some quantized candidate is far above that candidate's median unit (see above)."""
    flagged: set[str] = set()
    for name in measurement.candidates:
        if name == FP16:
            continue
        logs = {u.name: math.log10(u.options[name].error) for u in measurement.units if _positive(u, name)}
        if len(logs) < 3:  # a median of one or two units says nothing about outliers
            continue
        median = statistics.median(logs.values())
        mad = statistics.median(abs(x - median) for x in logs.values())
        for unit, x in logs.items():
            far = x - median >= math.log10(OUTLIER_FACTOR)
            if far and (mad == 0 or 0.6745 * (x - median) / mad > OUTLIER_Z):
                flagged.add(unit)
    return [u.name for u in measurement.units if u.name in flagged]


def summarize(measurement: Measurement) -> SensitivitySummary:
    """Per candidate: units, bits per weight, median error, mean error without outliers, worst unit."""
    outliers = outlier_units(measurement)
    summary = SensitivitySummary(measurement.mode, len(measurement.units), outliers=outliers)
    for name in measurement.candidates:
        units = [u for u in measurement.units if name in u.options]
        row = CandidateSummary(name, len(units))
        if units:
            errors = [u.options[name].error for u in units]
            kept = [u.options[name].error for u in units if u.name not in outliers]
            row.bits_per_weight = sum(u.options[name].bits for u in units) / sum(u.params for u in units)
            row.median_error = statistics.median(errors)
            row.mean_error = math.fsum(kept) / len(kept) if kept else None
            worst = max(units, key=lambda u: u.options[name].error)
            row.worst_unit = worst.name if worst.options[name].error > 0 else ""
        summary.candidates.append(row)
    return summary


def render_summary(summary: SensitivitySummary, title: str) -> Table:
    """The summary as a rich table, the outliers named in its caption."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("candidate")
    table.add_column("units", justify="right")
    table.add_column("bits/weight", justify="right")
    table.add_column("median error", justify="right")
    table.add_column("mean error" + (" (no outliers)" if summary.outliers else ""), justify="right")
    table.add_column("worst unit", justify="left")
    for row in summary.candidates:  # a candidate no engine loads for a unit is not measured there
        if not row.units:
            table.add_row(row.name, "0", "-", "-", "-", "no unit can hold it")
            continue
        table.add_row(
            row.name,
            f"{row.units}/{summary.total_units}",
            f"{row.bits_per_weight:.3f}",
            _error(row.median_error),
            _error(row.mean_error),
            short_unit_name(row.worst_unit) or "-",
        )
    table.caption = summary.caption()
    return table


def _positive(unit: UnitMeasurement, name: str) -> bool:
    return name in unit.options and unit.options[name].error > 0


def _error(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
