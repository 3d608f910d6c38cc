"""The head and the embedding in a plan file: the ``outer`` section a whole-model plan writes, and the quantize
options it stands for.

File layout (a tied head that the run does not untie has no ``head`` entry)::

    outer:
      untied_head: true     # the source ties its head; the run must untie it (quantize --rotate hadamard)
      head: {scheme: int8, bits: 135296, predicted_error: 1.5e-07}
      embedding: {scheme: none, bits: 524288, predicted_error: 0.0}

Only ``scheme`` drives quantization: ``quantize --plan`` writes the head as ``--quantize-head <scheme>`` and the
embedding as ``--quantize-embedding <scheme>`` would ("none": float); ``bits`` and ``predicted_error`` are the
planner's predictions (``predicted_error`` is absent where the scheme was given, not measured).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator

from quantkit.mixed.measurement import outer_spelling
from quantkit.mixed.planner import Plan
from quantkit.schemas.fields import FileModel

FLAGS = {"head": "--quantize-head", "embedding": "--quantize-embedding"}


class OuterScheme(FileModel):
    scheme: Annotated[str, AfterValidator(outer_spelling)]  # as --quantize-head takes it; "none": float
    bits: int | None = None
    predicted_error: float | None = None


class OuterSection(FileModel):
    """A plan's ``outer`` section as written."""

    untied_head: bool = False
    head: OuterScheme | None = None
    embedding: OuterScheme | None = None


def outer_section(plan: Plan) -> dict[str, Any] | None:
    """The ``outer`` section of a whole-model plan that sets the head and the embedding (None: it sets neither)."""
    if not plan.outer:
        return None
    section: dict[str, Any] = {"untied_head": plan.untied_head}
    for choice in plan.outer:
        entry: dict[str, Any] = {"scheme": choice.scheme, "bits": choice.bits}
        if choice.error is not None:
            entry["predicted_error"] = choice.error
        section[choice.name] = entry
    return section


def planned_flags(section: dict[str, Any] | None) -> dict[str, str]:
    """``{"head": scheme, "embedding": scheme}`` as the plan sets them (absent: not set by the plan)."""
    section = section or {}
    return {name: str(section[name]["scheme"]).strip().lower() for name in FLAGS if section.get(name)}


def quantize_hint(plan: Plan, plan_path: str) -> str:
    """The command that applies the plan: ``quantize --plan`` sets the head and embedding itself; a rotation unties
    a tied head, and this says when the run needs it."""
    flags = planned_flags(outer_section(plan))
    rotate = " --rotate hadamard" if plan.untied_head else ""
    line = f"apply it: quantkit quantize {plan.model} -o OUT --plan {plan_path}{rotate}"
    quantized = [f"{FLAGS[name]} {scheme}" for name, scheme in flags.items() if scheme != "none"]
    if quantized:
        line += f" (the plan sets {' '.join(quantized)}; quantize applies them)"
    if plan.untied_head:
        line += "; the model ties its head, and the plan pays for the head --rotate hadamard unties"
    return line
