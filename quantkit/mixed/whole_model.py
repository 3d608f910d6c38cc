"""Whole-model budgets for the planner: the bytes a checkpoint holds outside the measured linears (the embedding, the
norms, the biases, and the head: tied, float or quantized), read from the source model's shard headers, so that
``plan --max-size-mb S --whole-model`` plans a checkpoint of at most S MB on disk, as users compare sizes.

The head: a head tied to the embedding costs nothing of its own; a checkpoint with its own head (an untied source,
or ``--untied-head`` for a run whose rotation unties it) pays for it in float, or in the ``--head`` scheme that
``quantize --quantize-head`` will write. Scales are counted at 16 bits (the storage dtype of bf16/fp16 models).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from quantkit.errors import QuantkitError
from quantkit.format.files import shard_files
from quantkit.format.outer_engines import head_problem
from quantkit.format.tensors import storage_bits
from quantkit.mixed.measurement import Measurement

_DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "I16": 16, "F16": 16, "BF16": 16}
_DTYPE_BITS |= {"I32": 32, "F32": 32, "U32": 32, "I64": 64, "F64": 64, "U64": 64}
HEAD_NAME, EMBED_LEAF = "lm_head.weight", "embed_tokens.weight"
SHAPE_BITS = 128  # a quantized linear's weight_shape: int64 [2], which storage_bits leaves out


@dataclass(frozen=True, slots=True)
class OuterCost:
    """Bits a checkpoint holds outside the measured linears' weights."""

    fixed_bits: int  # every tensor outside them but the head: the embedding (float or quantized), norms, biases
    head_bits: int  # the checkpoint's own head (0: tied to the embedding)
    head: str  # "tied", "float" or the head scheme's spelling
    embedding: str = "none"  # the embedding scheme's spelling ("none": float), counted in fixed_bits

    @property
    def bits(self) -> int:
        return self.fixed_bits + self.head_bits


def _source_tensors(source: Path) -> dict[str, tuple[tuple[int, ...], int]]:
    """name -> (shape, bits per element) of every tensor in the source's shards (headers only)."""
    tensors = {}
    for f in shard_files(source):
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                sl = handle.get_slice(key)
                tensors[key] = (tuple(sl.get_shape()), _DTYPE_BITS[sl.get_dtype()])
    return tensors


def outer_cost(
    measurement: Measurement, source: Path, head: str = "none", untied_head: bool = False, embedding: str = "none"
) -> OuterCost:
    """The bits outside ``measurement``'s units for a checkpoint of ``source``; ``head`` / ``embedding``: their
    schemes as ``quantize --quantize-head`` / ``--quantize-embedding`` spell them ("none": float); ``untied_head``:
    the run unties a tied head (a rotation). Quantizing a tied head or embedding is refused."""
    from quantkit.quantization.methods.head_quant import head_scheme  # the one spelling of head schemes

    head_s, embed_s = head_scheme(head, "rtn"), head_scheme(embedding, "rtn")
    tensors = _source_tensors(source)
    measured = {f"{module}.weight" for unit in measurement.units for module in unit.modules}
    missing = sorted(measured - set(tensors))
    if missing:
        raise QuantkitError(
            f"{source} has no tensor {missing[0]} of the measurement; plan with the model the measurement was made on"
        )
    tied = not (HEAD_NAME in tensors and not _config_ties(source)) and not untied_head
    if tied and (head_s is not None or embed_s is not None) and head_problem(head_s or embed_s, tied=True):
        option = "--head" if head_s is not None else "--embedding"
        raise QuantkitError(
            f"{option} {head if head_s is not None else embedding}: the model ties its head to the embedding; add "
            "--untied-head (for a run with --rotate hadamard, which unties them) or plan them in float"
        )
    fixed = sum(math.prod(shape) * bits for key, (shape, bits) in tensors.items() if key not in measured)
    fixed += SHAPE_BITS * len(measured)  # each quantized linear's weight_shape, counted for all: an upper bound
    if HEAD_NAME in tensors:
        fixed -= math.prod(tensors[HEAD_NAME][0]) * tensors[HEAD_NAME][1]
    embed = next((k for k in tensors if k.endswith(EMBED_LEAF)), None)
    if embed is None:
        raise QuantkitError(f"{source} has no embedding ({EMBED_LEAF}); whole-model budgets need one")
    (vocab, hidden), embed_bits = tensors[embed]
    if embed_s is not None:
        fixed += storage_bits(embed_s, vocab, hidden) + SHAPE_BITS - vocab * hidden * embed_bits
    if tied:
        return OuterCost(fixed, 0, "tied", embedding.lower())
    shape, bits = tensors[HEAD_NAME] if HEAD_NAME in tensors else tensors[embed]
    if head_s is None:
        return OuterCost(fixed, math.prod(shape) * bits, "float", embedding.lower())
    return OuterCost(fixed, storage_bits(head_s, *shape) + SHAPE_BITS, head.lower(), embedding.lower())


# A safetensors header entry is '"<name>":{"dtype":"BF16","shape":[N,K],"data_offsets":[A,B]},': at most the name
# plus 96 bytes for 2-D shapes under 10^6 and offsets under 10^11 bytes. A quantized linear (or head, embedding) writes
# at most 5 tensors (weight_packed/weight, weight_scale, weight_zero_point or a global scale, input scales,
# weight_shape), each name at most 20 bytes longer than the module's. A shard adds its 8-byte length, the
# {"__metadata__":{"format":"pt"}} object and up to 7 bytes of padding: 64 bytes at most.
_ENTRY_BYTES, _SUFFIX_BYTES, _PARTS, _SHARD_BYTES, _MAX_SHARD = 96, 20, 5, 64, 2 * 1024**3


def header_bits(measurement: Measurement, source: Path, max_size_mb: float) -> int:
    """An upper bound on the safetensors headers of a checkpoint of ``source`` (written in 2 GiB shards at most), so
    that a whole-model budget bounds the files' bytes, as the recipes' ``max_checkpoint_mb`` gate counts them."""
    tensors = _source_tensors(source)
    quantizable = {f"{module}.weight" for unit in measurement.units for module in unit.modules}
    quantizable |= {HEAD_NAME} | {k for k in tensors if k.endswith(EMBED_LEAF)}
    entries = sum(
        _PARTS * (len(key) + _SUFFIX_BYTES + _ENTRY_BYTES) if key in quantizable else len(key) + _ENTRY_BYTES
        for key in tensors
    )
    if HEAD_NAME not in tensors:  # a head the run unties is written as lm_head.*
        entries += _PARTS * (len(HEAD_NAME) + _SUFFIX_BYTES + _ENTRY_BYTES)
    shards = math.ceil(max_size_mb * 1e6 / _MAX_SHARD) + 1
    return 8 * (entries + shards * _SHARD_BYTES)


@dataclass(frozen=True, slots=True)
class OuterTables:
    """A whole-model budget with the head and the embedding as units: the bits outside the linears that do not depend
    on their schemes, and each scheme's own bits (keyed by ``--quantize-head`` spellings)."""

    rest_bits: int  # norms, biases, weight_shape tensors: outer_cost's fixed bits less the float embedding
    head: dict[str, int]  # empty: a tied head (no bits of its own, no choice)
    embedding: dict[str, int]


def outer_tables(
    measurement: Measurement, source: Path, heads: list[str], embeddings: list[str], untied_head: bool = False
) -> OuterTables:
    """:func:`outer_cost` split per choice: ``rest_bits + head[h] + embedding[e]`` equals
    ``outer_cost(measurement, source, h, untied_head, e).bits`` for every pair (tied heads: ``head`` is empty)."""
    tensors = _source_tensors(source)
    embed = next((k for k in tensors if k.endswith(EMBED_LEAF)), None)
    base = outer_cost(measurement, source, "none", untied_head, "none")
    assert embed is not None  # outer_cost refuses a source without one
    float_embedding = math.prod(tensors[embed][0]) * tensors[embed][1]
    rest = base.fixed_bits - float_embedding
    embedding = {e: outer_cost(measurement, source, "none", untied_head, e).fixed_bits - rest for e in embeddings}
    head = {h: outer_cost(measurement, source, h, untied_head, "none").head_bits for h in heads}  # refuses tied ones
    return OuterTables(rest, {} if base.head == "tied" else head, embedding)


def _config_ties(source: Path) -> bool:
    import json

    return bool(json.loads((source / "config.json").read_text()).get("tie_word_embeddings", False))
