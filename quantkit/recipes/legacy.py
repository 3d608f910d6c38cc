"""Recipes written before ``quantization.solvers``: their flat keys (``method: awq+gptq``, ``damp``, ``rotate``,
``tune_steps``, ``refit_head`` ...) are read as the solvers they stand for, with one warning that shows the new
form; their values keep their file locations, so errors still point at the line that holds them."""

from __future__ import annotations

import warnings
from typing import Any

import yaml

from quantkit.errors import QuantkitError
from quantkit.quantization.methods import registry
from quantkit.quantization.methods.composition import DEFAULT_METHOD, parse_method
from quantkit.schemas.located import LocatedDict, format_where, plain

# flat key -> (algorithm, its field); None: the key names the algorithms (method) or switches one on (true)
FLAT_KEYS: dict[str, tuple[str, str | None]] = {
    "damp": ("gptq", "damp"),
    "float_targets": ("float_targets", None),
    "rotate": ("rotation", "kind"),
    "rotate_seed": ("rotation", "seed"),
    "tune_steps": ("tune", "steps"),
    "tune_lr": ("tune", "lr"),
    "tune_scale_lr": ("tune", "scale_lr"),
    "tune_batch_windows": ("tune", "batch_windows"),
    "refit_head": ("head_refit", None),
}
# what switches an algorithm off in the flat form (an algorithm whose switch key is absent stays off)
_OFF = {"rotation": ("kind", "none"), "tune": ("steps", 0)}


class LegacyRecipe(FutureWarning):
    """A recipe in the flat form that ``quantization.solvers`` replaced."""


def upgrade_flat_keys(quantization: Any, label: str) -> None:
    """Move ``quantization``'s flat keys into ``quantization.solvers``, in place, warning once."""
    if not isinstance(quantization, LocatedDict):
        return
    flat = [k for k in ("method", *FLAT_KEYS) if k in quantization]
    if not flat:
        return
    if "solvers" in quantization:
        raise QuantkitError(
            f"{label}: quantization has both 'solvers' and the old flat keys ({', '.join(flat)}); move them into "
            "solvers (see `quantkit recipe new`)"
        )
    method_where = quantization.where_of("method")
    method = quantization.pop("method", DEFAULT_METHOD)
    try:
        names = [registry.of(config).name for config in parse_method(str(method))]
    except QuantkitError as exc:
        raise QuantkitError(f"{format_where(label, method_where)}: quantization.method: {exc}") from None
    solvers = LocatedDict(where=method_where)
    for name in names:
        solvers[name] = LocatedDict(where=method_where)
    for key in FLAT_KEYS:
        if key not in quantization:
            continue
        where, value = quantization.where_of(key), quantization.pop(key)
        algorithm, field = FLAT_KEYS[key]
        if field is None:
            if value is True:
                solvers.setdefault(algorithm, LocatedDict(where=where))
            continue
        if algorithm == "gptq" and "gptq" not in solvers:
            continue  # the flat form checked damp for every method and used it with GPTQ only
        section = solvers.setdefault(algorithm, LocatedDict(where=where))
        section[field] = value
        section.key_where[field] = where
    for algorithm, (field, off) in _OFF.items():
        if algorithm in solvers and solvers[algorithm].get(field, off) == off:
            del solvers[algorithm]
    quantization["solvers"] = solvers
    quantization.key_where["solvers"] = solvers.where
    shown = yaml.safe_dump(plain(solvers), default_flow_style=True, width=1000).strip()
    warnings.warn(
        f"{label}: quantization.{', '.join(flat)} are the old flat form; write `solvers: {shown}` under "
        "quantization instead (`quantkit recipe new` shows it)",
        LegacyRecipe,
        stacklevel=2,
    )
