"""A mixed-precision plan (YAML from `quantkit plan`) turned into a storage scheme per linear of a model, ready
for ``QuantizeConfig.planned``, and into the head's and the embedding's quantize options (a whole-model plan's
``outer`` section): the quantizer itself never reads plan files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError
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


def with_planned_outer(path: Path, values: dict[str, Any]) -> dict[str, Any]:
    """The quantize option values with the plan's head and embedding schemes (its ``outer`` section) set: the plan
    sized the checkpoint with them. A different scheme given on the command line is refused."""
    from quantkit.mixed.plan_outer import FLAGS, planned_flags
    from quantkit.quantization.options import job_options

    planned = planned_flags(load_plan(Path(path)).outer)
    merged = dict(values)
    for name, scheme in planned.items():
        option = next(o for o in job_options() if FLAGS[name] in o.flags)
        given = str(merged.get(option.param, option.default)).strip().lower()
        if given not in (scheme, str(option.default)):
            raise QuantkitError(
                f"{FLAGS[name]} {given}: the plan {path} sized the checkpoint with {FLAGS[name]} {scheme}; drop "
                f"{FLAGS[name]} (the plan sets it) or re-plan with --{name} {given}"
            )
        merged[option.param] = scheme
    return merged


_ALGORITHMS = {"head": "head_quant", "embedding": "embed_quant"}  # the methods that write them (registry names)


def with_planned_outer_configs(path: Path, configs: list[Any]) -> list[Any]:
    """A recipe's algorithm configs with the plan's head and embedding schemes (its ``outer`` section) written in:
    the plan sized the checkpoint with them. A recipe that writes one of them as another scheme is refused; one that
    leaves it out gets the plan's (a plan without an ``outer`` section sets neither)."""
    import dataclasses

    from quantkit.mixed.plan_outer import planned_flags
    from quantkit.quantization.methods import registry

    out = list(configs)
    for name, scheme in planned_flags(load_plan(Path(path)).outer).items():
        algorithm = registry.by_name(_ALGORITHMS[name])
        index = next((i for i, c in enumerate(out) if registry.of(c) is algorithm), None)
        given = "none" if index is None else str(out[index].scheme).strip().lower()
        if given == scheme:
            continue
        if given != "none":
            raise QuantkitError(
                f"the plan {path} sized the checkpoint with the {name} as {scheme}, and the recipe writes it as "
                f"{given}; drop `{algorithm.name}` from the recipe's quantization solvers (the plan sets it) or set "
                f"`{algorithm.name}: {{scheme: {scheme}}}`"
            )
        if index is None:
            out.append(algorithm.config(scheme=scheme))
        else:
            out[index] = dataclasses.replace(out[index], scheme=scheme)
    order = [a.name for a in registry.algorithms()]  # the run order configs_of gives
    return sorted(out, key=lambda c: order.index(registry.of(c).name))
