"""Recipes: one YAML file describing calibrate -> (sensitivity -> plan) -> quantize -> evaluate -> gates -> smoke.

The schema is a tree of dataclasses; loading checks every key against it. Errors name the file, the line and
the key path, say what was expected, and suggest the closest valid key for a typo. String values may use
``${VAR}`` or ``${VAR:-default}`` (an unquoted value is re-typed after substitution, so ``bits: ${BITS:-4}`` is an
integer), and ``--set a.b=c`` overrides any key (the value is parsed as YAML). Relative paths are relative to the
current directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from quantkit.data.calibration_config import SELECTIONS, STRATEGIES
from quantkit.errors import QuantkitError
from quantkit.format.scheme import SUPPORTED_BITS, QuantScheme
from quantkit.mixed.measurement import MODES as SENSITIVITY_MODES
from quantkit.quantize.config import METHODS
from quantkit.quantize.methods import default_solver_options

DEFAULT_CANDIDATES = ("int4-g128", "int4-g64", "int4-g32", "int8", "fp16")
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class RecipeError(QuantkitError):
    """An invalid recipe: the message names the file, the line and the key path."""


# --------------------------------------------------------------------------------------------------
# Schema. Field metadata: "choices", "min", "max", "regex" (each string must compile), "doc".
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class CalibrationSection:
    dataset: str | None = None  # file, directory or HF dataset; None: the shipped Austen corpus
    num_samples: int = field(default=128, metadata={"min": 1})
    seq_len: int = field(default=512, metadata={"min": 2})
    seed: int = 0
    strategy: str = field(default="random", metadata={"choices": STRATEGIES})
    select: str = field(default="random", metadata={"choices": SELECTIONS})
    min_length: int | None = field(default=None, metadata={"min": 1})
    text_column: str = "text"


@dataclass(slots=True)
class SchemeSection:
    bits: int = field(default=4, metadata={"choices": SUPPORTED_BITS})
    group_size: int = field(default=128, metadata={"min": -1})
    symmetric: bool | None = None  # None: symmetric, except asymmetric for AWQ (as in AutoAWQ)
    act_order: bool | None = None  # None: the method's default (on for gptq and awq+gptq)
    static_groups: bool | None = None  # None: on (no g_idx)
    mse_clip: bool | None = None  # None: on for gptq (Hessian-weighted)


@dataclass(slots=True)
class MixedSection:
    target_bits: float | None = field(default=None, metadata={"min": 1e-9})
    max_size_mb: float | None = field(default=None, metadata={"min": 1e-9})
    candidates: list[str] = field(default_factory=lambda: list(DEFAULT_CANDIDATES))
    pins: dict[str, str] = field(default_factory=dict, metadata={"regex": True})  # regex -> candidate
    mode: str = field(default="proxy", metadata={"choices": SENSITIVITY_MODES})


@dataclass(slots=True)
class QuantizationSection:
    method: str = field(default="gptq", metadata={"choices": METHODS})
    scheme: SchemeSection = field(default_factory=SchemeSection)
    damp: float = field(default=0.01, metadata={"min": 0.0, "max": 0.999})
    ignore: list[str] = field(default_factory=list, metadata={"regex": True})
    mixed: MixedSection | None = None  # a per-unit plan under a bit budget, instead of one scheme
    plan: str | None = None  # an existing plan YAML (quantkit plan), instead of one scheme

    def quant_scheme(self) -> QuantScheme:
        s = self.scheme
        symmetric = s.symmetric if s.symmetric is not None else not self.method.startswith("awq")
        defaults = default_solver_options(self.method)
        return QuantScheme(
            s.bits,
            s.group_size,
            symmetric,
            defaults["act_order"] if s.act_order is None else s.act_order,
            defaults["static_groups"] if s.static_groups is None else s.static_groups,
            defaults["mse_clip"] if s.mse_clip is None else s.mse_clip,
        )


@dataclass(slots=True)
class OutputSection:
    directory: str
    force: bool = False  # replace an existing directory that does not hold this recipe's checkpoint


@dataclass(slots=True)
class EvaluationSection:
    dataset: str | None = None  # None: the shipped held-out Persuasion text
    windows: int | None = field(default=40, metadata={"min": 1})  # None: every window
    seq_len: int = field(default=512, metadata={"min": 2})
    reference: str | None = None  # None: the recipe's model
    batch_size: int = field(default=4, metadata={"min": 1})


@dataclass(slots=True)
class GatesSection:
    max_ppl_increase_pct: float | None = None
    max_kl_mean: float | None = field(default=None, metadata={"min": 0.0})
    min_top1_agreement: float | None = field(default=None, metadata={"min": 0.0, "max": 1.0})


@dataclass(slots=True)
class SmokeSection:
    enabled: bool = False
    prompts: list[str] | None = None  # None: the smoke module's default prompts
    max_tokens: int = field(default=16, metadata={"min": 1})


@dataclass(slots=True)
class Recipe:
    model: str
    output: OutputSection
    calibration: CalibrationSection = field(default_factory=CalibrationSection)
    quantization: QuantizationSection = field(default_factory=QuantizationSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    gates: GatesSection = field(default_factory=GatesSection)
    smoke: SmokeSection = field(default_factory=SmokeSection)


# --------------------------------------------------------------------------------------------------
# YAML with locations
# --------------------------------------------------------------------------------------------------


class LineDict(dict):
    """A mapping that remembers where each key came from ("line 12" or "--set a.b=c")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.where: dict[Any, str] = {}
        self.self_where = ""


class LineList(list):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.where: list[str] = []


class _Loader(yaml.SafeLoader):
    label = "recipe"


def _line(node: yaml.Node) -> str:
    return f"line {node.start_mark.line + 1}"


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> LineDict:
    loader.flatten_mapping(node)
    result = LineDict()
    result.self_where = _line(node)
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in result:
            raise RecipeError(f"{loader.label}:{key_node.start_mark.line + 1}: duplicate key '{key}'; keep one")
        result[key] = loader.construct_object(value_node, deep=True)
        result.where[key] = _line(key_node)
    return result


def _construct_sequence(loader: _Loader, node: yaml.SequenceNode) -> LineList:
    result = LineList(loader.construct_object(child, deep=True) for child in node.value)
    result.where = [_line(child) for child in node.value]
    return result


def _construct_str(loader: _Loader, node: yaml.ScalarNode) -> Any:
    text = loader.construct_scalar(node)
    if "${" not in text:
        return text
    substituted = substitute_env(text, f"{loader.label}:{node.start_mark.line + 1}")
    if node.style is None:  # unquoted: type the result as YAML would (${BITS:-4} -> 4)
        typed = yaml.safe_load(substituted) if substituted.strip() else None
        if not isinstance(typed, (dict, list)):
            return typed
    return substituted


_Loader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)
_Loader.add_constructor("tag:yaml.org,2002:seq", _construct_sequence)
_Loader.add_constructor("tag:yaml.org,2002:str", _construct_str)


def substitute_env(text: str, where: str) -> str:
    """Replace ``${VAR}`` and ``${VAR:-default}``; an unset variable without a default is an error."""

    def replace(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        value = os.environ.get(name)
        if value is None or (value == "" and default is not None):
            if default is None:
                raise RecipeError(
                    f"{where}: environment variable '{name}' is not set and has no default; "
                    f"export it or write ${{{name}:-default}}"
                )
            return default
        return value

    return _ENV.sub(replace, text)


def parse_yaml(text: str, label: str) -> LineDict:
    loader = _Loader(text)
    loader.label = label
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else "?"
        raise RecipeError(f"{label}:{line}: invalid YAML: {exc.problem or exc.context}; fix the syntax there") from exc
    except yaml.YAMLError as exc:
        raise RecipeError(f"{label}: invalid YAML ({exc})") from exc
    finally:
        loader.dispose()
    if data is None:
        raise RecipeError(f"{label}: the recipe is empty; start from `quantkit recipe new`")
    if not isinstance(data, LineDict):
        raise RecipeError(f"{label}:1: a recipe must be a YAML mapping with keys {_field_names(Recipe)}")
    return data


# --------------------------------------------------------------------------------------------------
# --set overrides
# --------------------------------------------------------------------------------------------------


def apply_overrides(data: LineDict, overrides: list[str], label: str) -> None:
    """``a.b.c=value``: set (creating intermediate mappings); the value is parsed as YAML (``8`` is an int)."""
    for expr in overrides:
        path, sep, raw = expr.partition("=")
        keys = path.strip().split(".")
        if not sep or not all(keys):
            raise RecipeError(f"--set {expr!r}: expected KEY.PATH=VALUE, e.g. --set quantization.scheme.bits=8")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise RecipeError(f"--set {expr!r}: the value is not valid YAML ({exc})") from exc
        if isinstance(value, str) and "${" in value:
            value = substitute_env(value, f"--set {expr}")
        node = data
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if not isinstance(child, LineDict):
                if child is not None:
                    where = ".".join(keys[: depth + 1])
                    raise RecipeError(f"{label} (--set {expr}): '{where}' is not a mapping, cannot set a key in it")
                child = LineDict()
                child.self_where = f"--set {expr}"
                node[key] = child
                node.where[key] = f"--set {expr}"
            node = child
        node[keys[-1]] = _to_line_types(value, f"--set {expr}")
        node.where[keys[-1]] = f"--set {expr}"


def _to_line_types(value: Any, where: str) -> Any:
    if isinstance(value, dict):
        out = LineDict({k: _to_line_types(v, where) for k, v in value.items()})
        out.where = dict.fromkeys(value, where)
        out.self_where = where
        return out
    if isinstance(value, list):
        lst = LineList(_to_line_types(v, where) for v in value)
        lst.where = [where] * len(value)
        return lst
    return value


# --------------------------------------------------------------------------------------------------
# Typed conversion against the dataclasses
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Ctx:
    label: str

    def fail(self, where: str, path: str, problem: str) -> RecipeError:
        loc = f"{self.label}:{where.removeprefix('line ')}" if where.startswith("line ") else f"{self.label} ({where})"
        return RecipeError(f"{loc}: {path}: {problem}" if path else f"{loc}: {problem}")


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(parts) + " (or null)"
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "a mapping of strings to strings"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(_field_names(tp))}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    return f"{type(value).__name__} {value!r}"


def _convert(value: Any, tp: Any, path: str, where: str, ctx: _Ctx) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _convert(value, args[0], path, where, ctx)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ctx.fail(where, path, f"expected {_describe(tp)}, got {_shown(value)}")
        return _build(tp, value, path, ctx)
    if origin is list:
        if not isinstance(value, list):
            raise ctx.fail(where, path, f"expected {_describe(tp)}, got {_shown(value)}")
        item_where = getattr(value, "where", [where] * len(value))
        (item_type,) = typing.get_args(tp)
        return [_convert(v, item_type, f"{path}[{i}]", item_where[i], ctx) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ctx.fail(where, path, f"expected {_describe(tp)}, got {_shown(value)}")
        key_where = getattr(value, "where", {})
        out = {}
        for k, v in value.items():
            kw = key_where.get(k, where)
            out[_convert(k, str, f"{path} key", kw, ctx)] = _convert(v, str, f"{path}.{k}", kw, ctx)
        return out
    return _scalar(value, tp, path, where, ctx)


def _scalar(value: Any, tp: type, path: str, where: str, ctx: _Ctx) -> Any:
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[tp]
    if not ok:
        hint = " (quote it)" if tp is str and isinstance(value, (int, float, bool)) else ""
        raise ctx.fail(where, path, f"expected {_describe(tp)}, got {_shown(value)}{hint}")
    return float(value) if tp is float else value


def _build(cls: type, data: dict, path: str, ctx: _Ctx) -> Any:
    wheres: dict = getattr(data, "where", {})
    self_where = getattr(data, "self_where", "") or "line 1"
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            full = f"{path}.{key}" if path else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys here: {', '.join(fields)}"
            raise ctx.fail(wheres.get(key, self_where), full, f"unknown key '{key}'{hint}")
    kwargs = {}
    for name, f in fields.items():
        full = f"{path}.{name}" if path else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                where_text = path or "the recipe"
                raise ctx.fail(self_where, full, f"missing required key '{name}' in {where_text}")
            continue
        where = wheres.get(name, self_where)
        value = _convert(data[name], hints[name], full, where, ctx)
        _check_meta(value, f.metadata, full, where, data[name], ctx)
        kwargs[name] = value
    return cls(**kwargs)


def _check_meta(value: Any, meta: Any, path: str, where: str, raw: Any, ctx: _Ctx) -> None:
    if value is None:
        return
    if "choices" in meta and value not in meta["choices"]:
        choices = ", ".join(map(str, meta["choices"]))
        close = difflib.get_close_matches(str(value), [str(c) for c in meta["choices"]], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ctx.fail(where, path, f"expected one of {choices}, got {value!r}{hint}")
    if "min" in meta and value < meta["min"]:
        raise ctx.fail(where, path, f"expected a value >= {meta['min']:g}, got {value!r}")
    if "max" in meta and value > meta["max"]:
        raise ctx.fail(where, path, f"expected a value <= {meta['max']:g}, got {value!r}")
    if meta.get("regex"):
        items = list(value) if isinstance(value, (list, dict)) else [value]
        item_where = getattr(raw, "where", None)
        for i, pattern in enumerate(items):
            try:
                re.compile(pattern)
            except re.error as exc:
                loc = item_where[i] if isinstance(item_where, list) else (item_where or {}).get(pattern, where)
                raise ctx.fail(
                    loc, f"{path}[{i}]", f"'{pattern}' is not a valid regular expression ({exc}); escape it"
                ) from exc


# --------------------------------------------------------------------------------------------------
# Cross-field checks
# --------------------------------------------------------------------------------------------------


def _check_recipe(recipe: Recipe, data: LineDict, ctx: _Ctx) -> None:
    quant_raw = data.get("quantization") or LineDict()
    qw = getattr(quant_raw, "where", {})
    q_where = getattr(quant_raw, "self_where", "line 1") or "line 1"
    q = recipe.quantization
    if q.mixed is not None and q.plan is not None:
        raise ctx.fail(qw.get("plan", q_where), "quantization", "give either 'mixed' or 'plan', not both")
    if (q.mixed is not None or q.plan is not None) and "scheme" in quant_raw:
        raise ctx.fail(
            qw.get("scheme", q_where),
            "quantization.scheme",
            "a scheme does not apply with 'mixed' or 'plan' (the plan picks a scheme per layer); remove it",
        )
    scheme = q.scheme
    if scheme.group_size == 0 or scheme.group_size < -1:
        where = getattr(quant_raw.get("scheme"), "where", {}).get("group_size", q_where)
        raise ctx.fail(where, "quantization.scheme.group_size", "expected a positive size such as 64 or 128, or -1")
    if q.mixed is not None:
        _check_mixed(q.mixed, quant_raw.get("mixed"), ctx)


def _check_mixed(mixed: MixedSection, raw: Any, ctx: _Ctx) -> None:
    from quantkit.mixed.candidates import parse_candidate

    where = getattr(raw, "self_where", "line 1") or "line 1"
    wheres = getattr(raw, "where", {})
    if (mixed.target_bits is None) == (mixed.max_size_mb is None):
        raise ctx.fail(where, "quantization.mixed", "give exactly one budget: target_bits (e.g. 4.5) or max_size_mb")
    if not mixed.candidates:
        raise ctx.fail(wheres.get("candidates", where), "quantization.mixed.candidates", "expected at least one")
    for i, name in enumerate([*mixed.candidates, *mixed.pins.values()]):
        try:
            parse_candidate(name)
        except QuantkitError as exc:
            key = "candidates" if i < len(mixed.candidates) else "pins"
            raise ctx.fail(wheres.get(key, where), f"quantization.mixed.{key}", str(exc)) from exc


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def recipe_from_text(text: str, label: str = "recipe", overrides: list[str] | None = None) -> Recipe:
    data = parse_yaml(text, label)
    apply_overrides(data, list(overrides or []), label)
    ctx = _Ctx(label)
    recipe = _build(Recipe, data, "", ctx)
    _check_recipe(recipe, data, ctx)
    return recipe


def load_recipe(path: Path | str, overrides: list[str] | None = None) -> Recipe:
    """Read, substitute, override and validate a recipe file."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file '{path}' not found; create one with `quantkit recipe new -o {path}`")
    return recipe_from_text(path.read_text(), str(path), overrides)


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """Plain data; a None equal to the field's default is left out, and so is the scheme under a plan."""
    data = _section_dict(recipe)
    if recipe.quantization.mixed is not None or recipe.quantization.plan is not None:
        data["quantization"].pop("scheme")
    return data


def _section_dict(section: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if value is None and f.default is None:
            continue
        if dataclasses.is_dataclass(value):
            value = _section_dict(value)
        elif isinstance(value, (list, dict)):
            value = type(value)(value)
        out[f.name] = value
    return out


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, default_flow_style=False, width=1000)
