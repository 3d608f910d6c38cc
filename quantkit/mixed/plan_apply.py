"""A mixed-precision plan (YAML from `quantkit plan`) turned into a scheme per linear."""

from __future__ import annotations

from pathlib import Path

from quantkit.format.scheme import QuantScheme
from quantkit.mixed.plan_file import load_plan
from quantkit.model.architectures import ArchSpec
from quantkit.quantize.assignment import SchemeAssignment, block_linears


def assignment_from_plan(path: Path, arch: ArchSpec, num_layers: int) -> SchemeAssignment:
    """Every block linear gets the scheme of the plan rule that matches it; unmatched or fp16 ones stay float."""
    names = block_linears(arch, num_layers)
    fused = [
        [f"{arch.layers_path}.{i}.{linear}" for linear in group]
        for i in range(num_layers)
        for group in arch.fused_groups
    ]
    rules = load_plan(path, known_modules=names, fused_groups=fused)
    schemes: dict[str, QuantScheme | None] = dict.fromkeys(names)
    for scheme, modules in rules.groups():
        for module in modules:
            schemes[module] = scheme
    return SchemeAssignment(schemes)
