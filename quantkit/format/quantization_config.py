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
from dataclasses import dataclass, field, replace
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.format.layouts import LAYOUTS, MIXED_PRECISION, NAIVE_QUANTIZED, layout_for
from quantkit.format.scheme import (
    ACTIVATION_STRATEGIES,
    FLOAT_BITS,
    SUPPORTED_BITS,
    ActivationScheme,
    KVCacheScheme,
    QuantScheme,
)

QUANT_METHOD = "compressed-tensors"
PACK_FORMAT = "pack-quantized"
COMPRESSED_TENSORS_FORMAT = "0.20.0"  # the compressed-tensors release whose format quantkit writes
# how compressed-tensors names the scale dtypes it records (the others take the model's dtype: null)
_SCALE_DTYPE_NAMES = {"fp8": "torch.float8_e4m3fn", "e8m0": "torch.uint8"}


# --------------------------------------------------------------------------------------------------
# quantization_config
# --------------------------------------------------------------------------------------------------


def _actorder(scheme: QuantScheme) -> str | None:
    if not scheme.act_order:
        return None
    return "weight" if scheme.static_groups else "group"


def _weights_args(scheme: QuantScheme) -> dict[str, Any]:
    args: dict[str, Any] = {
        "num_bits": scheme.bits,
        "type": scheme.type,
        "symmetric": scheme.symmetric,
        "strategy": scheme.strategy,
        "group_size": scheme.group_size if scheme.group_size > 0 else None,
        "dynamic": False,
        "observer": "mse" if scheme.mse_clip else "minmax",
    }
    if scheme.act_order:  # compressed-tensors 0.20 omits the unset ones
        args["actorder"] = _actorder(scheme)
    if scheme.block:
        args["block_structure"] = [scheme.block, scheme.block]
    if scheme.scale_format in _SCALE_DTYPE_NAMES:
        args["scale_dtype"] = _SCALE_DTYPE_NAMES[scheme.scale_format]
    return args


def _activation_args(acts: ActivationScheme, observer: str) -> dict[str, Any]:
    args: dict[str, Any] = {
        "num_bits": acts.bits,
        "type": acts.type,
        "symmetric": acts.symmetric,
        "strategy": acts.strategy,
        "group_size": acts.group_size,
        "dynamic": acts.dynamic,
    }
    if acts.dynamic is not True:  # compressed-tensors 0.20 records the observer of calibrated scales only
        args["observer"] = observer
    if acts.scale_format in _SCALE_DTYPE_NAMES:
        args["scale_dtype"] = _SCALE_DTYPE_NAMES[acts.scale_format]
    return args


def _kv_cache_args(kv: KVCacheScheme) -> dict[str, Any]:
    return {
        "num_bits": kv.bits,
        "type": kv.type,
        "symmetric": True,
        "strategy": kv.strategy,
        "group_size": None,
        "dynamic": False,
    }


def build_quantization_config(
    groups: list[tuple[QuantScheme, list[str]]],
    ignore: list[str],
    *,
    kv_cache: KVCacheScheme | None = None,
    activation_observer: str = "static_minmax",
) -> dict[str, Any]:
    """``quantization_config`` for config.json; one config group per (scheme, targets) pair, in order.

    Later groups win when the same target string appears twice (compressed-tensors semantics), so prefer
    disjoint targets: e.g. ``["Linear"]`` for the default scheme plus ``["re:.*down_proj$"]`` overrides. Each group
    names its compressed-tensors format; the checkpoint's is that one, or ``mixed-precision`` when they differ.
    ``activation_observer`` names how static input scales were calibrated.
    """
    if not groups:
        raise QuantkitError("no quantized layers: give at least one (scheme, targets) group")
    config_groups: dict[str, Any] = {}
    formats = []
    for i, (scheme, targets) in enumerate(groups):
        if not targets:
            raise QuantkitError(f"group {i} ({scheme.name}) has no targets; use 'Linear' or 're:<module regex>'")
        for target in targets:
            _check_target(target)
        acts = scheme.activations
        formats.append(layout_for(scheme).format)
        config_groups[f"group_{i}"] = {
            "targets": list(targets),
            "weights": _weights_args(scheme),
            "input_activations": None if acts is None else _activation_args(acts, activation_observer),
            "output_activations": None,
            "format": formats[-1],
        }
    for target in ignore:
        _check_target(target)
    return {
        "quant_method": QUANT_METHOD,
        "format": formats[0] if len(set(formats)) == 1 else MIXED_PRECISION,
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": list(ignore),
        "kv_cache_scheme": None if kv_cache is None else _kv_cache_args(kv_cache),
        # the rest of the keys compressed-tensors 0.20 writes, so a checkpoint's config reads as llm-compressor's
        "global_compression_ratio": None,
        "moe_sparsity_config": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_FORMAT,
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
    kv_cache: KVCacheScheme | None = None  # the attention's key/value cache in FP8 under stored scales

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
        f"unsupported quantization_config: {what}; quantkit reads the compressed-tensors formats "
        f"{', '.join(LAYOUTS)} with the schemes their presets define"
    )


def _strategy(group: str, args: Mapping[str, Any]) -> str:
    group_size = args.get("group_size")
    strategy = args.get("strategy") or ("channel" if group_size == -1 else "group" if group_size else "tensor")
    return str(strategy).lower()


def _scheme_from_args(group: str, args: Mapping[str, Any], acts: ActivationScheme | None) -> QuantScheme:
    kind = str(args.get("type", "int")).lower()
    if kind not in ("int", "float"):
        raise _unsupported(f"{group} quantizes weights to type {args.get('type')!r}")
    if args.get("dynamic", False):
        raise _unsupported(f"{group} uses dynamic weight quantization")
    bits = int(args.get("num_bits", 8))
    allowed = SUPPORTED_BITS if kind == "int" else FLOAT_BITS
    if bits not in allowed:
        raise _unsupported(f"{group} uses {bits}-bit {kind} weights (supported: {list(allowed)})")
    strategy = _strategy(group, args)
    group_size = args.get("group_size")
    block = 0
    if strategy == "channel":
        group_size = -1
    elif strategy == "tensor" and kind == "float":
        group_size = 0
    elif strategy == "block" and kind == "float":
        structure = list(args.get("block_structure") or [])
        if len(structure) != 2 or structure[0] != structure[1] or int(structure[0]) <= 0:
            raise _unsupported(f"{group} uses block structure {structure!r} (quantkit reads square blocks)")
        group_size, block = 0, int(structure[0])
    elif strategy not in ("group", "tensor_group") or not group_size or group_size <= 0:
        raise _unsupported(f"{group} uses strategy {strategy!r} with group_size {group_size!r}")
    scale_dtype = str(args.get("scale_dtype") or "")
    scale_format = next((f for f, name in _SCALE_DTYPE_NAMES.items() if name == scale_dtype), "native")
    if kind == "float" and bits == 4 and scale_format == "native":  # compressed-tensors' FP4 defaults
        scale_format = "e8m0" if group_size == 32 else "fp8"
    actorder = args.get("actorder")
    actorder = str(actorder).lower() if actorder not in (None, False) else None
    if actorder not in (None, "group", "dynamic", "weight", "static"):
        raise _unsupported(f"{group} uses actorder {args.get('actorder')!r}")
    try:
        return QuantScheme(
            bits=bits,
            group_size=int(group_size),
            symmetric=bool(args.get("symmetric", True)),
            act_order=actorder is not None,
            static_groups=actorder in ("weight", "static"),
            mse_clip=args.get("observer") == "mse",
            type=kind,
            scale_format=scale_format,
            block=block,
            activations=acts,
        )
    except QuantkitError as exc:
        raise _unsupported(f"{group}: {exc}") from exc


def _unpacked(group: str, scheme: QuantScheme) -> QuantScheme:
    try:
        return replace(scheme, unpacked=True)
    except QuantkitError as exc:
        raise _unsupported(f"{group} is naive-quantized: {exc}") from exc


def _activations_from_args(group: str, args: Mapping[str, Any] | None) -> ActivationScheme | None:
    if not args:
        return None
    strategy = _strategy(group, args)
    dynamic = args.get("dynamic", False)
    if strategy not in ACTIVATION_STRATEGIES or dynamic not in (True, False, "local"):
        raise _unsupported(f"{group} quantizes activations with strategy {strategy!r}, dynamic {dynamic!r}")
    if not args.get("symmetric", True):
        raise _unsupported(f"{group} quantizes activations asymmetrically")
    try:
        return ActivationScheme(
            type=str(args.get("type", "int")).lower(),
            bits=int(args.get("num_bits", 8)),
            strategy=strategy,
            dynamic=dynamic,
            group_size=args.get("group_size"),
        )
    except QuantkitError as exc:
        raise _unsupported(f"{group}: {exc}") from exc


def _kv_cache_from_args(args: Mapping[str, Any] | None) -> KVCacheScheme | None:
    if not args:
        return None
    kind, bits, strategy = str(args.get("type", "")).lower(), int(args.get("num_bits", 0)), _strategy("kv", args)
    if args.get("dynamic", False) or not args.get("symmetric", True):
        raise _unsupported("a dynamic or asymmetric kv-cache scheme")
    try:
        return KVCacheScheme(type=kind, bits=bits, strategy=strategy)
    except QuantkitError as exc:
        raise _unsupported(f"kv_cache_scheme: {exc}") from exc


def parse_quantization_config(cfg: Mapping[str, Any]) -> QuantizationLayout:
    """Read a compressed-tensors ``quantization_config`` dict; QuantkitError for what quantkit cannot load."""
    if cfg.get("quant_method") != QUANT_METHOD:
        raise _unsupported(f"quant_method is {cfg.get('quant_method')!r}, not {QUANT_METHOD!r}")
    top_format = cfg.get("format")
    if top_format not in (*LAYOUTS, MIXED_PRECISION):
        raise _unsupported(f"format is {top_format!r}")
    if cfg.get("quantization_status", "compressed") != "compressed":
        raise _unsupported(f"quantization_status is {cfg.get('quantization_status')!r}, not 'compressed'")
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
        if group.get("output_activations"):
            raise _unsupported(f"{name} quantizes output activations")
        if not group.get("weights"):
            raise _unsupported(f"{name} has no weight quantization")
        targets = tuple(group.get("targets") or ())
        if not targets:
            raise _unsupported(f"{name} has no targets")
        acts = _activations_from_args(name, group.get("input_activations"))
        scheme = _scheme_from_args(name, group["weights"], acts)
        if group.get("format") == NAIVE_QUANTIZED.format and not scheme.is_float and scheme.activations is None:
            scheme = _unpacked(name, scheme)  # INT codes a byte each, as the group asks compressed-tensors to
        written = layout_for(scheme).format
        for declared in (group.get("format"), None if top_format == MIXED_PRECISION else top_format):
            if declared not in (None, written):
                raise _unsupported(f"{name} is declared {declared!r}, but compressed-tensors writes it {written!r}")
        for target in targets:
            _check_target(target)
            target_schemes.pop(target, None)  # keep config order, last group wins
            target_schemes[target] = scheme
        groups.append((scheme, targets))
    ignore = tuple(cfg.get("ignore") or ())
    kv_cache = _kv_cache_from_args(cfg.get("kv_cache_scheme"))
    return QuantizationLayout(target_schemes, ignore, tuple(groups), kv_cache)
