"""A plan as YAML a person can read and edit, and its validated form ready for ``quantization_config``.

File layout (one rule per unit; a fused unit's rule covers all its modules)::

    model: HuggingFaceTB/SmolLM2-135M
    mode: proxy
    budget: {target_bits: 4.5, max_size_mb: null, bits: ..., pins: [{pattern: down_proj, scheme: int8}]}
    totals: {bits: ..., params: ..., bits_per_weight: ..., size_mb: ..., predicted_error: ...}
    rules:
    - target: re:^model\\.layers\\.3\\.self_attn\\.(q_proj|k_proj|v_proj)$
      scheme: int4-g64
      predicted_error: 0.0123
      bits: 1234567
      params: 552960

A whole-model plan adds an ``outer`` section: the head's and the embedding's schemes (:mod:`.plan_outer`).
A target is an exact module name or ``re:<regex>`` matched with ``re.match`` (compressed-tensors rules).
Only ``target`` and ``scheme`` drive quantization; ``predicted_error``, ``bits``, ``params``, ``budget`` and
``totals`` are what the planner predicted and are kept as written (re-run ``quantkit plan`` to refresh them).
Saving, loading and saving again gives the same text. :class:`PlanFile` is the file's schema; errors name
``file:line`` and the rule, e.g. ``plan.yaml:7: rules[0] (target 're:^...$').scheme: unknown scheme ...``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import yaml
from pydantic import AfterValidator, Field

from quantkit.atomic import write_text
from quantkit.errors import QuantkitError
from quantkit.format.scheme import QuantScheme
from quantkit.format.sizes import format_mb, mb_number
from quantkit.mixed.candidates import FP16, SYNTAX, did_you_mean, parse_candidate
from quantkit.mixed.plan_outer import OuterSection, outer_section
from quantkit.mixed.planner import Plan, UniformPoint
from quantkit.schemas.fields import FileModel
from quantkit.schemas.located import load_yaml, plain
from quantkit.schemas.validate import error_at, validate

if TYPE_CHECKING:
    from rich.table import Table

HEADER = (
    "# quantkit mixed-precision plan. Edit a rule's `scheme` (int<bits>[-g<group>][-asym], nvfp4, mxfp4, mxfp8,\n"
    "# fp8 or fp16), then run `quantkit quantize --plan <this file>`. predicted_error/bits/params/totals are the\n"
    "# planner's predictions.\n"
)


@dataclass(slots=True)
class PlanRule:
    target: str  # exact module name or "re:<regex>"
    scheme_name: str  # candidate name, e.g. "int4-g64" or "fp16"
    predicted_error: float | None = None
    bits: int | None = None
    params: int | None = None

    @property
    def scheme(self) -> QuantScheme | None:
        return parse_candidate(self.scheme_name)

    def matches(self, module: str) -> bool:
        if self.target.startswith("re:"):
            return re.match(self.target[3:], module) is not None
        return self.target == module

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"target": self.target, "scheme": self.scheme_name}
        for key in ("predicted_error", "bits", "params"):
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        return data


@dataclass(slots=True)
class PlanRules:
    model: str
    rules: list[PlanRule]
    mode: str | None = None
    budget: dict[str, Any] = field(default_factory=dict)
    totals: dict[str, Any] = field(default_factory=dict)
    assignment: dict[str, int] | None = None  # module -> rule index (when loaded with known_modules)
    unmatched: list[str] = field(default_factory=list)  # known modules no rule covers: left unquantized
    outer: dict[str, Any] | None = None  # the head's and the embedding's schemes (plan_outer.py)

    def groups(self) -> list[tuple[QuantScheme, list[str]]]:
        """(scheme, targets) in first-appearance order: module names when modules are known, else rule targets.

        fp16 rules are not included; see :meth:`ignore`. Ready for ``build_quantization_config(groups, ignore)``.
        """
        by_scheme: dict[QuantScheme, list[str]] = {}
        for scheme, target in self._targets():
            if scheme is not None:
                by_scheme.setdefault(scheme, []).append(target)
        return list(by_scheme.items())

    def ignore(self) -> list[str]:
        """Modules (or targets) the plan leaves unquantized (fp16 rules)."""
        return [target for scheme, target in self._targets() if scheme is None]

    def _targets(self) -> list[tuple[QuantScheme | None, str]]:
        if self.assignment is None:
            return [(rule.scheme, rule.target) for rule in self.rules]
        return [(self.rules[i].scheme, module) for module, i in self.assignment.items()]

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"model": self.model}
        if self.mode is not None:
            data["mode"] = self.mode
        data |= {"budget": self.budget, "totals": self.totals, "rules": [r.to_dict() for r in self.rules]}
        return data | ({"outer": self.outer} if self.outer else {})


# --------------------------------------------------------------------------------------------------
# Plan -> rules -> YAML
# --------------------------------------------------------------------------------------------------


def module_target(modules: Iterable[str]) -> str:
    """An anchored ``re:`` target matching exactly ``modules``, e.g. ``re:^a\\.b\\.(q_proj|k_proj)$``."""
    names = list(modules)
    if len(names) == 1:
        return f"re:^{re.escape(names[0])}$"
    parts = [name.split(".") for name in names]
    common = 0
    while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    prefix = ".".join(parts[0][:common]) + ("." if common else "")
    rests = "|".join(re.escape(".".join(p[common:])) for p in parts)
    return f"re:^{re.escape(prefix)}({rests})$"


def plan_rules(plan: Plan) -> PlanRules:
    """The editable rules of a plan: one rule per unit."""
    budget = {
        "target_bits": plan.target_bits,
        "max_size_mb": plan.max_size_mb,
        "bits": plan.budget_bits,
        "pins": [{"pattern": p, "scheme": c} for p, c in plan.pins],
    }
    totals = {
        "bits": plan.total_bits,
        "params": plan.total_params,
        "bits_per_weight": round(plan.bits_per_weight, 6),
        "size_mb": round(plan.size_mb, 6),
        "predicted_error": plan.predicted_error,
    }
    rules = [PlanRule(module_target(u.modules), u.candidate, u.error, u.bits, u.params) for u in plan.units]
    outer = outer_section(plan)
    return PlanRules(model=plan.model, rules=rules, mode=plan.mode, budget=budget, totals=totals, outer=outer)


def dump_plan(plan: Plan | PlanRules) -> str:
    rules = plan_rules(plan) if isinstance(plan, Plan) else plan
    body = yaml.safe_dump(rules.to_dict(), sort_keys=False, default_flow_style=False, width=1000, allow_unicode=True)
    return HEADER + body


def save_plan(plan: Plan | PlanRules, path: Path) -> Path:
    """Write the plan YAML atomically (:func:`quantkit.atomic.write_text`: flushed before the rename)."""
    path = Path(path)
    write_text(path, dump_plan(plan))
    return path


# --------------------------------------------------------------------------------------------------
# The file schema
# --------------------------------------------------------------------------------------------------


def _check_target(target: str) -> str:
    if not target.strip():
        raise ValueError("needs a `target`: a module name or re:<regex>")
    if target.startswith("re:"):
        try:
            re.compile(target[3:])
        except re.error as exc:
            raise ValueError(f"invalid regular expression: {exc}") from exc
    return target


def _check_scheme(scheme: str) -> str:
    try:
        parse_candidate(scheme)
    except QuantkitError:
        raise ValueError(f"unknown scheme {scheme!r}; {did_you_mean(scheme)}use {SYNTAX}") from None
    return scheme


class RuleEntry(FileModel):
    """One rule as written: only ``target`` and ``scheme`` drive quantization."""

    target: Annotated[str, AfterValidator(_check_target)]  # exact module name or "re:<regex>"
    scheme: Annotated[str, AfterValidator(_check_scheme)]  # candidate name, e.g. "int4-g64" or "fp16"
    predicted_error: float | None = None
    bits: int | None = None
    params: int | None = None


class PlanFile(FileModel):
    """A plan file as written; ``budget`` and ``totals`` are the planner's predictions, kept as they are."""

    model: str = ""
    mode: str | None = None
    budget: dict[str, Any] | None = None
    totals: dict[str, Any] | None = None
    rules: list[RuleEntry] = Field(min_length=1)
    outer: OuterSection | None = None  # whole-model plans: the head's and the embedding's schemes


_ITEM_LABELS = {"rules": "target '{target}'"}


# --------------------------------------------------------------------------------------------------
# YAML -> validated rules
# --------------------------------------------------------------------------------------------------


def load_plan(
    path: Path,
    *,
    known_modules: Iterable[str] | None = None,
    fused_groups: list[list[str]] | None = None,
) -> PlanRules:
    """The validated rules of a (possibly hand-edited) plan; errors name ``file:line``, the rule and the problem.

    ``known_modules``: the model's quantizable Linear names; with them every rule must match a module, a
    module may not get two different schemes, and :meth:`PlanRules.groups` lists module names.
    ``fused_groups``: full module names that must share a scheme (a member no rule covers counts as fp16).
    """
    path = Path(path)
    if not path.is_file():
        raise QuantkitError(f"plan file {path} does not exist; create it with `quantkit plan`")
    label = str(path)
    data = load_yaml(path.read_text(), label)
    checked = validate(PlanFile, data, label, item_labels=_ITEM_LABELS)
    rules = [PlanRule(r.target, r.scheme, r.predicted_error, r.bits, r.params) for r in checked.rules]
    plan = PlanRules(
        model=checked.model,
        rules=rules,
        mode=checked.mode,
        budget=plain(checked.budget or {}),
        totals=plain(checked.totals or {}),
        outer=None if checked.outer is None else plain(data["outer"]),
    )
    if known_modules is not None:
        plan.assignment, plan.unmatched = _assign(label, data, rules, list(known_modules))
    if fused_groups:
        _check_fused(label, data, rules, fused_groups)
    return plan


def _assign(label: str, data: Any, rules: list[PlanRule], modules: list[str]) -> tuple[dict[str, int], list[str]]:
    """module -> rule index, and the modules no rule covers; every rule must match a module, none gets two schemes."""
    assignment: dict[str, int] = {}
    used = [False] * len(rules)
    for module in modules:
        for i, rule in enumerate(rules):
            if not rule.matches(module):
                continue
            used[i] = True
            first = assignment.setdefault(module, i)
            if rules[first].scheme != rule.scheme:
                raise error_at(
                    label,
                    data,
                    ("rules", i),
                    f"module {module!r} is matched by rule {first} ({rules[first].scheme_name}) and rule {i} "
                    f"({rule.scheme_name}) with different schemes; narrow one target or give both the same scheme",
                )
    for i, rule in enumerate(rules):
        if not used[i]:
            raise error_at(
                label,
                data,
                ("rules", i),
                f"rule {i} (target {rule.target!r}) matches no module of the model; "
                "fix the target (module name or re:<regex>, matched from the start) or delete the rule",
            )
    return assignment, [m for m in modules if m not in assignment]


def _check_fused(label: str, data: Any, rules: list[PlanRule], fused_groups: list[list[str]]) -> None:
    for group in fused_groups:
        hits = [next((i for i, r in enumerate(rules) if r.matches(module)), None) for module in group]
        schemes = {rules[hit].scheme if hit is not None else None for hit in hits}
        if len(schemes) > 1:
            labels = [
                f"{module}: " + (f"{rules[hit].scheme_name} (rule {hit})" if hit is not None else f"{FP16} (no rule)")
                for module, hit in zip(group, hits, strict=True)
            ]
            first = next(hit for hit in hits if hit is not None)
            raise error_at(
                label,
                data,
                ("rules", first),
                f"fused modules must share one scheme (runtimes load them as one matrix), got {', '.join(labels)}; "
                "give them the same scheme",
            )


# --------------------------------------------------------------------------------------------------
# Display
# --------------------------------------------------------------------------------------------------


def render_plan(plan: Plan) -> Table:
    """A rich table: one row per unit (pinned units marked *), totals in the caption."""
    from rich.table import Table

    table = Table(title=f"Mixed-precision plan for {plan.model} ({plan.mode} errors)")
    for col, justify in (("unit", "left"), ("scheme", "left"), ("bits/w", "right"), ("predicted error", "right")):
        table.add_column(col, justify=justify)
    for unit in plan.units:
        scheme = unit.candidate + (" *" if unit.pinned else "")
        table.add_row(unit.name, scheme, f"{unit.bits_per_weight:.3f}", f"{unit.error:.4g}")
    pinned = " (* pinned)" if any(u.pinned for u in plan.units) else ""
    table.caption = (
        f"{len(plan.units)} units, {plan.total_params:,} weights: {plan.bits_per_weight:.3f} bits/w, "
        f"{format_mb(plan.total_bits / 8, decimals=2)} (budget {plan.budget_bits / plan.total_params:.3f} bits/w, "
        f"{format_mb(plan.budget_bits / 8, decimals=2)}; 1 MB = 10^6 bytes); predicted error "
        f"{plan.predicted_error:.4g}{pinned}"
    )
    return table


def render_uniform_comparison(plan: Plan, uniform: list[UniformPoint]) -> Table:
    """The plan beside the uniform schemes (every unit on one candidate), by predicted error."""
    from rich.table import Table

    table = Table(title=f"Plan vs uniform schemes ({plan.mode} errors, measured Linears)")
    for col in ("scheme", "bits/w", "MB", "predicted error", "vs plan"):
        table.add_column(col, justify="left" if col == "scheme" else "right")
    rows = [("[bold]this plan[/]", plan.total_bits, plan.bits_per_weight, plan.predicted_error)]
    rows += [(p.candidate, p.bits, p.bits_per_weight, p.predicted_error) for p in uniform]
    for name, bits, bpw, error in sorted(rows, key=lambda r: r[1]):
        ratio = "-" if plan.predicted_error == 0 else f"{error / plan.predicted_error:.2f}x"
        table.add_row(name, f"{bpw:.3f}", mb_number(bits / 8), f"{error:.4g}", ratio)
    table.caption = "predicted errors, the sum the planner minimises; `quantkit eval` measures the real KL"
    return table
