"""Plot of the planner's error-vs-size frontier (optional: needs matplotlib, ``pip install 'quantkit[plot]'``)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.mixed.measurement import Measurement
from quantkit.mixed.planner import Plan, plan_frontier


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise QuantkitError("plotting needs matplotlib; install it with `pip install 'quantkit[plot]'`") from exc
    return Figure, FigureCanvasAgg


def plot_frontier(measurement: Measurement, chosen: Plan, path: Path, budgets: Iterable[float] | None = None) -> Path:
    """PNG of predicted error vs bits per weight over a range of budgets, with ``chosen`` marked.

    ``budgets``: bits-per-weight targets (default: evenly spaced over the reachable range); the chosen
    plan's pins apply to every point. No pyplot state is touched (safe in servers and threads).
    """
    figure_cls, canvas_cls = _matplotlib()
    plans = plan_frontier(measurement, budgets, pins=chosen.pins)
    fig = figure_cls(figsize=(7, 4.5), dpi=120)
    canvas_cls(fig)
    ax = fig.add_subplot()
    ax.plot([p.bits_per_weight for p in plans], [p.predicted_error for p in plans], "o-", ms=3, label="optimal plans")
    ax.plot([chosen.bits_per_weight], [chosen.predicted_error], "r*", ms=14, label="chosen")
    ax.annotate(f"{chosen.bits_per_weight:.3f} bits/w", (chosen.bits_per_weight, chosen.predicted_error),
                textcoords="offset points", xytext=(8, 8))  # fmt: skip
    ax.set_xlabel("bits per weight (measured Linears)")
    ax.set_ylabel(f"predicted error ({measurement.mode})")
    positive = [p.predicted_error for p in [*plans, chosen] if p.predicted_error > 0]
    if positive and max(positive) > 100 * min(positive):  # errors span decades; symlog keeps exact zeros
        ax.set_yscale("symlog", linthresh=min(positive))
    ax.set_title(f"Size/error frontier: {measurement.model}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", bbox_inches="tight")
    return path
