"""A mixed-precision plan (YAML from `quantkit plan`) turned into a storage scheme per linear of a model, ready
for ``QuantizeConfig.planned``: the quantizer itself never reads plan files."""

from __future__ import annotations

from pathlib import Path

from quantkit.format.scheme import QuantScheme
from quantkit.mixed.plan_file import load_plan
from quantkit.model.architectures import ArchSpec
from quantkit.quantization.assignment import block_linears


def schemes_from_plan(path: Path, arch: ArchSpec, num_layers: int) -> dict[str, QuantScheme | None]:
    """Every block linear gets the scheme of the plan rule that matches it; unmatched or fp16 ones stay float."""
    names = block_linears(arch, num_layers)
    fused = [
        [f"{arch.layers_path}.{i}.{linear}" for linear in group]
        for i in range(num_layers)
        for group in arch.for_layer(i).fused_groups  # a hybrid model's layers differ
    ]
    rules = load_plan(path, known_modules=names, fused_groups=fused)
    schemes: dict[str, QuantScheme | None] = dict.fromkeys(names)
    for scheme, modules in rules.groups():
        for module in modules:
            schemes[module] = scheme
    return schemes


def planned_schemes(path: Path, model: str | Path) -> dict[str, QuantScheme | None]:
    """:func:`schemes_from_plan` for the float model ``model`` (directory, hub id or alias)."""
    from quantkit.model.resolve import arch_for_dir, resolve_model
    from quantkit.quantization.job import num_layers_of

    source = resolve_model(model)
    return schemes_from_plan(Path(path), arch_for_dir(source), num_layers_of(source))
