"""Plots of a measurement and its plan (optional: needs matplotlib, ``pip install 'quantkit[plot]'``).

- :func:`plot_frontier`: the planner's error-vs-size frontier, the chosen plan and the uniform schemes (every unit
  on one candidate) as reference points, so a plan that beats uniform at its size shows below them;
- :func:`plot_unit_errors`: each unit's error (KL for kl/hybrid measurements) per candidate, in model order, with
  the candidate the plan chose.

No pyplot state is touched (safe in servers and threads).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.extras import install_command
from quantkit.mixed.candidates import FP16
from quantkit.mixed.measurement import Measurement
from quantkit.mixed.planner import Plan, UniformPoint, plan_frontier, uniform_points

PLOT_EXTRA = "plot"
INSTALL_HINT = install_command(PLOT_EXTRA)
_ERROR_LABELS = {"proxy": "proxy error (Hessian-weighted)", "kl": "KL (nats)", "hybrid": "KL (nats, hybrid)"}


def plotting_unavailable() -> str | None:
    """Why plots cannot be drawn here (matplotlib missing, with the install hint), or None when they can."""
    try:
        _matplotlib()
    except QuantkitError as exc:
        return str(exc)
    return None


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise QuantkitError(f"plotting needs matplotlib; install it with `{INSTALL_HINT}`") from exc
    return Figure, FigureCanvasAgg


def _figure(size: tuple[float, float]) -> tuple[Any, Any]:
    figure_cls, canvas_cls = _matplotlib()
    fig = figure_cls(figsize=size, dpi=120)
    canvas_cls(fig)
    return fig, fig.add_subplot()


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", bbox_inches="tight")
    return path


def plot_frontier(measurement: Measurement, chosen: Plan, path: Path, budgets: Iterable[float] | None = None) -> Path:
    """PNG of predicted error vs bits per weight over a range of budgets, with ``chosen`` and the uniform schemes
    marked: the whole range on the left, the neighbourhood of the chosen plan (within 1 bit per weight) on the right.

    ``budgets``: bits-per-weight targets (default: evenly spaced over the reachable range); the chosen
    plan's pins apply to every point. Uniform points: every candidate measured on all units except fp16.
    """
    figure_cls, canvas_cls = _matplotlib()
    plans = plan_frontier(measurement, budgets, pins=chosen.pins)
    uniform = [p for p in uniform_points(measurement) if p.candidate != FP16]
    fig = figure_cls(figsize=(11, 4.5), dpi=120)
    canvas_cls(fig)
    whole, near = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    _draw_frontier(whole, plans, uniform, chosen, None)
    window = (chosen.bits_per_weight - 1, chosen.bits_per_weight + 1)
    local = plan_frontier(measurement, [window[0] + i / 8 for i in range(17)], pins=chosen.pins)  # denser here
    _draw_frontier(near, sorted([*plans, *local], key=lambda p: p.bits_per_weight), uniform, chosen, window)
    whole.set_ylabel(f"predicted error ({measurement.mode})")
    whole.set_title("whole range", fontsize=10)
    near.set_title("within 1 bit/w of the chosen plan", fontsize=10)
    whole.legend(fontsize=8)
    fig.suptitle(f"Size/error frontier: {measurement.model}")
    return _save(fig, path)


def _draw_frontier(
    ax: Any, plans: list[Plan], uniform: list[UniformPoint], chosen: Plan, window: tuple[float, float] | None
) -> None:
    def inside(x: float) -> bool:
        return window is None or window[0] <= x <= window[1]

    curve = [(p.bits_per_weight, p.predicted_error) for p in plans if inside(p.bits_per_weight)]
    marks = [p for p in uniform if inside(p.bits_per_weight)]
    ax.plot([x for x, _ in curve], [y for _, y in curve], "o-", ms=3, label="optimal plans")
    if marks:
        ax.plot([p.bits_per_weight for p in marks], [p.predicted_error for p in marks], "s", ms=7,
                color="tab:gray", label="uniform schemes")  # fmt: skip
        for i, point in enumerate(marks):  # labels alternate below and above: neighbours do not overlap
            ax.annotate(point.candidate, (point.bits_per_weight, point.predicted_error), textcoords="offset points",
                        xytext=(5, -13 if i % 2 == 0 else 6), fontsize=8, color="dimgray")  # fmt: skip
    ax.plot([chosen.bits_per_weight], [chosen.predicted_error], "r*", ms=14, label="chosen")
    ax.annotate(f"{chosen.bits_per_weight:.3f} bits/w", (chosen.bits_per_weight, chosen.predicted_error),
                textcoords="offset points", xytext=(8, 8), fontsize=8)  # fmt: skip
    errors = [y for _, y in curve] + [p.predicted_error for p in marks] + [chosen.predicted_error]
    positive = [e for e in errors if e > 0]
    if window is None and positive and max(positive) > 100 * min(positive):  # decades; symlog keeps exact zeros
        ax.set_yscale("symlog", linthresh=min(positive))
    ax.set_xlabel("bits per weight (measured Linears)")
    ax.grid(True, alpha=0.3)


def plot_unit_errors(measurement: Measurement, path: Path, chosen: Plan | None = None) -> Path:
    """PNG of each unit's error per quantized candidate, units in model order; ``chosen``'s pick per unit marked."""
    fig, ax = _figure((max(7.0, 0.09 * len(measurement.units) + 3), 4.5))
    xs = list(range(len(measurement.units)))
    for name in measurement.candidates:
        if name == FP16:
            continue
        points = [(x, u.options[name].error) for x, u in zip(xs, measurement.units, strict=True) if name in u.options]
        if points:
            ax.plot([x for x, _ in points], [e for _, e in points], ".-", ms=4, lw=0.8, label=name)
    if chosen is not None:
        picks = {u.name: u for u in chosen.units}
        marked = [(x, picks[u.name].error) for x, u in zip(xs, measurement.units, strict=True) if u.name in picks]
        ax.plot([x for x, _ in marked], [e for _, e in marked], "kx", ms=5, label="plan's choice")
    errors = [c.error for u in measurement.units for c in u.options.values() if c.error > 0]
    if errors and max(errors) > 100 * min(errors):
        ax.set_yscale("symlog", linthresh=min(errors))
    ticks = _layer_ticks([u.name for u in measurement.units])
    ax.set_xticks([x for x, _ in ticks], [label for _, label in ticks], fontsize=7)
    ax.set_xlabel("unit (model order; tick: first unit of a decoder layer)")
    ax.set_ylabel(_ERROR_LABELS.get(measurement.mode, "error"))
    ax.set_title(f"Per-layer sensitivity ({measurement.mode}): {measurement.model}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _layer_ticks(names: list[str]) -> list[tuple[int, str]]:
    """(index, "L<n>") at each unit that starts a new decoder layer (names holding ``layers.<n>.``)."""
    ticks: list[tuple[int, str]] = []
    last = None
    for i, name in enumerate(names):
        parts = name.split(".")
        layer = next((parts[j + 1] for j, p in enumerate(parts[:-1]) if p == "layers"), None)
        if layer is not None and layer != last:
            ticks.append((i, f"L{layer}"))
            last = layer
    step = max(1, len(ticks) // 16)  # at most ~16 labels
    return ticks[::step] if ticks else [(i, str(i)) for i in range(0, len(names), max(1, len(names) // 16))]
