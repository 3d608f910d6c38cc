"""What a quantization run meant for each block linear, for the coverage audit
(:mod:`quantkit.format.coverage`): the scheme asked before the layout policy changed it, why a linear is kept in
float, and whether its solve fell back to round-to-nearest."""

from __future__ import annotations

from collections.abc import Iterable

from quantkit.format.coverage import FLOAT, Intent
from quantkit.quantization.assignment import SchemeAssignment
from quantkit.quantization.methods.records import LayerRecord


def linear_intents(assignment: SchemeAssignment, records: Iterable[LayerRecord], planned: bool) -> dict[str, Intent]:
    """Every linear of ``assignment`` (full module name) with what was meant for it; ``planned``: the schemes came
    from a plan (a float linear is the plan's choice), else from one scheme and ``--ignore``."""
    fell_back = {record.name for record in records if record.fell_back_to_rtn}
    intents = {}
    for name, scheme in assignment.schemes.items():
        asked = assignment.asked.get(name, scheme)
        intents[name] = Intent(
            scheme=FLOAT if asked is None else asked.name,
            float_by="" if scheme is not None else "plan" if planned else "ignore",
            layout=assignment.fallbacks.get(name, ""),
            rtn_fallback=name in fell_back,
        )
    return intents
