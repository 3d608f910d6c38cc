"""Which scheme each linear gets: resolved once, before the layer loop, then written as config groups."""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantkit.errors import QuantkitError
from quantkit.format.quantization_config import build_quantization_config
from quantkit.format.scheme import QuantScheme
from quantkit.model.architectures import ArchSpec


@dataclass(slots=True)
class SchemeAssignment:
    """Full module name -> scheme, or None for a linear kept in float."""

    schemes: dict[str, QuantScheme | None]

    def for_block(self, prefix: str) -> dict[str, QuantScheme | None]:
        """Relative names (e.g. ``self_attn.q_proj``) of one block's linears."""
        start = prefix + "."
        return {name[len(start) :]: s for name, s in self.schemes.items() if name.startswith(start)}

    def quantized(self) -> list[str]:
        return [name for name, s in self.schemes.items() if s is not None]

    def quantization_config(self) -> dict:
        """compressed-tensors config groups: ``Linear`` for a uniform scheme, exact names when mixed."""
        distinct = list(dict.fromkeys(s for s in self.schemes.values() if s is not None))
        if not distinct:
            raise QuantkitError("every linear is ignored: nothing would be quantized; loosen --ignore")
        ignore = ["lm_head", *(name for name, s in self.schemes.items() if s is None)]
        if len(distinct) == 1:
            return build_quantization_config([(distinct[0], ["Linear"])], ignore)
        groups = [(scheme, [n for n, s in self.schemes.items() if s == scheme]) for scheme in distinct]
        return build_quantization_config(groups, ["lm_head"])


def block_linears(arch: ArchSpec, num_layers: int) -> list[str]:
    return [f"{arch.layers_path}.{i}.{linear}" for i in range(num_layers) for linear in arch.linears]


def uniform_assignment(arch: ArchSpec, num_layers: int, scheme: QuantScheme, ignore: list[str]) -> SchemeAssignment:
    patterns = [re.compile(p) for p in ignore]
    schemes: dict[str, QuantScheme | None] = {}
    for name in block_linears(arch, num_layers):
        schemes[name] = None if any(p.search(name) for p in patterns) else scheme
    _check_fused(arch, num_layers, schemes)
    return SchemeAssignment(schemes)


def _check_fused(arch: ArchSpec, num_layers: int, schemes: dict[str, QuantScheme | None]) -> None:
    """Linears that runtimes fuse (q/k/v, gate/up) must share a scheme."""
    for i in range(num_layers):
        for group in arch.fused_groups:
            names = [f"{arch.layers_path}.{i}.{linear}" for linear in group]
            if len({schemes[n] for n in names}) > 1:
                raise QuantkitError(
                    f"{', '.join(names)} are fused by inference engines and must share one scheme; "
                    "adjust --ignore or the plan so they are treated alike"
                )
