"""The ``quantization_config`` of config.json: written from (scheme, targets) groups, and parsed into
which scheme each module gets.

Target matching follows compressed-tensors: a target is a class name (any class in the module's MRO), an
exact module name, or ``re:<pattern>`` matched with ``re.match`` (anchored at the start only). ``ignore``
uses the same rules. When several targets match, exact names win over regexes, regexes over class
names, ties broken by the target string's sort order; a target listed in several groups belongs to the
last of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.format.scheme import SUPPORTED_BITS, QuantScheme

QUANT_METHOD = "compressed-tensors"
PACK_FORMAT = "pack-quantized"


# --------------------------------------------------------------------------------------------------
# quantization_config
# --------------------------------------------------------------------------------------------------


def _actorder(scheme: QuantScheme) -> str | None:
    if not scheme.act_order:
        return None
    return "weight" if scheme.static_groups else "group"


def _weights_args(scheme: QuantScheme) -> dict[str, Any]:
    return {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "strategy": "channel" if scheme.per_channel else "group",
        "group_size": None if scheme.per_channel else scheme.group_size,
        "actorder": _actorder(scheme),
        "dynamic": False,
        "observer": "mse" if scheme.mse_clip else "minmax",
    }


def build_quantization_config(groups: list[tuple[QuantScheme, list[str]]], ignore: list[str]) -> dict[str, Any]:
    """``quantization_config`` for config.json; one config group per (scheme, targets) pair, in order.

    Later groups win when the same target string appears twice (compressed-tensors semantics), so prefer
    disjoint targets: e.g. ``["Linear"]`` for the default scheme plus ``["re:.*down_proj$"]`` overrides.
    """
    if not groups:
        raise QuantkitError("no quantized layers: give at least one (scheme, targets) group")
    config_groups: dict[str, Any] = {}
    for i, (scheme, targets) in enumerate(groups):
        if not targets:
            raise QuantkitError(f"group {i} ({scheme.name}) has no targets; use 'Linear' or 're:<module regex>'")
        for target in targets:
            _check_target(target)
        config_groups[f"group_{i}"] = {
            "targets": list(targets),
            "weights": _weights_args(scheme),
            "input_activations": None,
            "output_activations": None,
            "format": PACK_FORMAT,
        }
    for target in ignore:
        _check_target(target)
    return {
        "quant_method": QUANT_METHOD,
        "format": PACK_FORMAT,
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }


def _check_target(target: str) -> None:
    if target.startswith("re:"):
        try:
            re.compile(target[3:])
        except re.error as exc:
            raise QuantkitError(f"target {target!r} is not a valid regular expression: {exc}") from exc
    elif not target:
        raise QuantkitError("empty target; use a class name such as 'Linear', a module name, or 're:<regex>'")


def _match_name(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _class_names(class_name: str | Iterable[str]) -> tuple[str, ...]:
    names = (class_name,) if isinstance(class_name, str) else tuple(class_name)
    # compressed-tensors lets target "Linear" match vLLM's LinearBase
    return (*names, "Linear") if "LinearBase" in names else names


@dataclass(slots=True, frozen=True)
class QuantizationLayout:
    """Parsed ``quantization_config``: which scheme each module gets."""

    target_schemes: dict[str, QuantScheme]  # target -> scheme (last group wins, config order kept)
    ignore: tuple[str, ...] = ()
    groups: tuple[tuple[QuantScheme, tuple[str, ...]], ...] = field(default=())

    def is_ignored(self, module_name: str, class_name: str | Iterable[str] = "Linear") -> bool:
        classes = _class_names(class_name)
        return any(_match_name(module_name, t) or t in classes for t in self.ignore)

    def scheme_for(self, module_name: str, class_name: str | Iterable[str] = "Linear") -> QuantScheme | None:
        """Scheme of a module (``class_name``: its class, or all class names of its MRO), None if unquantized."""
        classes = _class_names(class_name)
        if self.is_ignored(module_name, classes):
            return None
        ordered = sorted(self.target_schemes, key=lambda t: ("re:" in t, t))
        by_name = [t for t in ordered if _match_name(module_name, t)]
        by_class = [t for t in ordered if t in classes and t not in by_name]
        matched = by_name + by_class
        return self.target_schemes[matched[0]] if matched else None

    @property
    def schemes(self) -> list[QuantScheme]:
        return [scheme for scheme, _ in self.groups]


def _unsupported(what: str) -> QuantkitError:
    return QuantkitError(
        f"unsupported quantization_config: {what}; quantkit reads compressed-tensors 'pack-quantized' "
        "checkpoints with int weight-only quantization (group or channel strategy)"
    )


def _scheme_from_args(group: str, args: Mapping[str, Any]) -> QuantScheme:
    if str(args.get("type", "int")).lower() != "int":
        raise _unsupported(f"{group} quantizes weights to type {args.get('type')!r}")
    if args.get("dynamic", False):
        raise _unsupported(f"{group} uses dynamic weight quantization")
    bits = int(args.get("num_bits", 8))
    if bits not in SUPPORTED_BITS:
        raise _unsupported(f"{group} uses {bits}-bit weights (supported: {list(SUPPORTED_BITS)})")
    group_size = args.get("group_size")
    strategy = args.get("strategy") or ("channel" if group_size == -1 else "group" if group_size else "tensor")
    strategy = str(strategy).lower()
    if strategy == "channel":
        group_size = -1
    elif strategy != "group" or not group_size or group_size <= 0:
        raise _unsupported(f"{group} uses strategy {strategy!r} with group_size {group_size!r}")
    actorder = args.get("actorder")
    actorder = str(actorder).lower() if actorder not in (None, False) else None
    if actorder not in (None, "group", "dynamic", "weight", "static"):
        raise _unsupported(f"{group} uses actorder {args.get('actorder')!r}")
    return QuantScheme(
        bits=bits,
        group_size=int(group_size),
        symmetric=bool(args.get("symmetric", True)),
        act_order=actorder is not None,
        static_groups=actorder in ("weight", "static"),
        mse_clip=args.get("observer") == "mse",
    )


def parse_quantization_config(cfg: Mapping[str, Any]) -> QuantizationLayout:
    """Read a compressed-tensors ``quantization_config`` dict; QuantkitError for what quantkit cannot load."""
    if cfg.get("quant_method") != QUANT_METHOD:
        raise _unsupported(f"quant_method is {cfg.get('quant_method')!r}, not {QUANT_METHOD!r}")
    if cfg.get("format") != PACK_FORMAT:
        raise _unsupported(f"format is {cfg.get('format')!r}, not {PACK_FORMAT!r}")
    if cfg.get("quantization_status", "compressed") != "compressed":
        raise _unsupported(f"quantization_status is {cfg.get('quantization_status')!r}, not 'compressed'")
    if cfg.get("kv_cache_scheme"):
        raise _unsupported("kv-cache quantization")
    if cfg.get("transform_config"):
        raise _unsupported("transforms (transform_config)")
    raw_groups = cfg.get("config_groups") or {}
    if not raw_groups:
        raise _unsupported("config_groups is empty")
    target_schemes: dict[str, QuantScheme] = {}
    groups: list[tuple[QuantScheme, tuple[str, ...]]] = []
    for name, group in raw_groups.items():
        if not isinstance(group, Mapping):
            raise _unsupported(f"{name} is a preset reference ({group!r}); write the scheme out in full")
        if group.get("input_activations") or group.get("output_activations"):
            raise _unsupported(f"{name} quantizes activations")
        if group.get("format") not in (None, PACK_FORMAT):
            raise _unsupported(f"{name} has format {group.get('format')!r}")
        if not group.get("weights"):
            raise _unsupported(f"{name} has no weight quantization")
        targets = tuple(group.get("targets") or ())
        if not targets:
            raise _unsupported(f"{name} has no targets")
        scheme = _scheme_from_args(name, group["weights"])
        for target in targets:
            _check_target(target)
            target_schemes.pop(target, None)  # keep config order, last group wins
            target_schemes[target] = scheme
        groups.append((scheme, targets))
    ignore = tuple(cfg.get("ignore") or ())
    return QuantizationLayout(target_schemes=target_schemes, ignore=ignore, groups=tuple(groups))
