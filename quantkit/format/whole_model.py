"""Every byte of a checkpoint, by what it holds: the quantized linears' codes, scales, zero points and layout
metadata, the float linears left in the blocks, the embedding and the head (float, or quantized: one row with all
their parts) and the norms. The rows add up to the
tensors' data bytes (the shards' sizes less their headers), which is what users compare at equal size (the
download, the memory), so ``quantkit inspect``, the planner and the benchmark tables quote whole-model sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from quantkit.format.coverage import EMBEDDINGS, HEAD, kind_of
from quantkit.format.tensors import G_IDX, GLOBAL, INPUT_GLOBAL, INPUT_SCALE, PACKED, SCALE, SHAPE, WEIGHT, ZERO

CODES, SCALES, ZEROS, METADATA = "codes", "scales", "zero points", "g_idx + shapes"
FLOAT_LINEARS, NORMS = "float linears", "norms/other"
QUANTIZED_EMBEDDINGS, QUANTIZED_HEAD = f"{EMBEDDINGS} (quantized)", f"{HEAD} (quantized)"
PART_ORDER = (CODES, SCALES, ZEROS, METADATA, FLOAT_LINEARS, EMBEDDINGS, QUANTIZED_EMBEDDINGS, HEAD, QUANTIZED_HEAD)
PART_ORDER += (NORMS,)
_WEIGHTS = (CODES, FLOAT_LINEARS, EMBEDDINGS, HEAD, NORMS)  # rows whose tensors hold weights (params counted)
_PART_OF = {PACKED: CODES, WEIGHT: CODES, SCALE: SCALES, GLOBAL: SCALES, INPUT_SCALE: SCALES}
_PART_OF |= {INPUT_GLOBAL: SCALES, ZERO: ZEROS, G_IDX: METADATA, SHAPE: METADATA}


@dataclass(frozen=True, slots=True)
class PartBytes:
    part: str  # one of PART_ORDER
    bytes: int
    params: int  # weights it stores (codes and float tensors; 0 for scales and metadata)


def part_of(key: str, quantized: set[str] | Mapping[str, int]) -> str:
    """Which row a tensor counts in: a quantized module's part, else the kind of float weight it is."""
    module, _, leaf = key.rpartition(".")
    kind = kind_of(module).name
    if module in quantized and leaf in _PART_OF:  # a quantized head or embedding: all its parts in one row
        return {EMBEDDINGS: QUANTIZED_EMBEDDINGS, HEAD: QUANTIZED_HEAD}.get(kind, _PART_OF[leaf])
    if kind in (EMBEDDINGS, HEAD):
        return kind
    return FLOAT_LINEARS if leaf == "weight" and kind_of(module).linears else NORMS


def whole_model_bytes(tensors: Mapping[str, tuple[int, int]], quantized: Mapping[str, int]) -> list[PartBytes]:
    """``tensors``: name -> (data bytes, elements); ``quantized``: the quantized modules and their weights' params
    (packed codes hold several a word). One row per part present, in :data:`PART_ORDER`; the rows sum to every
    tensor's bytes."""
    sums: dict[str, list[int]] = {}
    for key, (nbytes, numel) in tensors.items():
        part = part_of(key, quantized)
        row = sums.setdefault(part, [0, 0])
        row[0] += nbytes
        leaf = key.rpartition(".")[2]
        if part in (CODES, QUANTIZED_EMBEDDINGS, QUANTIZED_HEAD) and _PART_OF.get(leaf) == CODES:
            row[1] += quantized[key.rpartition(".")[0]]
        elif part in _WEIGHTS:
            row[1] += numel
    return [PartBytes(part, *sums[part]) for part in PART_ORDER if part in sums]
