"""llama.cpp's quantization mixes by name: which GGML type each tensor of a model gets.

The one home of the mix table. The rules are read from llama.cpp's ``src/llama-quant.cpp``
(``llama_ftype_get_default_type``, ``llama_tensor_get_type_impl``, ``tensor_type_fallback``) for dense models
without an importance matrix, and restated here as data: a mix has a base type and, per tensor category, an
ordered list of (condition, type) rules; the first rule whose condition holds decides. Then the row-length
fallback: a type whose block does not divide the row (in-features) is replaced by llama.cpp's fallback type
(Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0), or F16 when that does not divide it either.

Facts of llama.cpp kept as they are:
- Layer counters (attn_v's ``i_attention_wv``, ffn_down's ``i_ffn_down``) run in layer order, because llama.cpp
  visits tensors sorted by block number; for a dense model they equal the layer index.
- ``use_more_bits(i, n)``: the first eighth, the last eighth and every third layer in between.
- The output tensor (and token_embd when the model ties it to the output, as there is then no output.weight)
  gets Q6_K, or Q8_0 when its row is not a multiple of the base type's block, or when the base type is Q8_0.
- llama.cpp's 70B bump (attn_v Q3_K/Q4_K -> Q5_K) applies to the Llama architecture with 80 layers and grouped
  KV heads, as llama.cpp's model-size detection names them 70B.
- Q4_0's "ffn_down -> Q4_1 in the first eighth" applies only with an importance matrix (``has_imatrix``).
- Mixture-of-experts rules (``n_expert == 8``) are not restated: GGUF output here is dense models only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import gguf
from gguf import GGMLQuantizationType as QType

from quantkit.errors import QuantkitError

# tensor categories, named as llama.cpp's tensor_get_category names them
OUTPUT, TOKEN_EMBD, ATTN_V, ATTN_K, ATTN_Q, ATTN_OUTPUT = (
    "output",
    "token_embd",
    "attn_v",
    "attn_k",
    "attn_q",
    "attn_output",
)
FFN_UP, FFN_GATE, FFN_DOWN, OTHER = "ffn_up", "ffn_gate", "ffn_down", "other"
F16 = "F16"


@dataclass(frozen=True, slots=True)
class Layer:
    """Where a tensor sits, for the conditions: its layer (the category's counter), the layer count, the
    query heads per KV head, whether the model is what llama.cpp calls a 70B."""

    index: int
    count: int
    gqa: int = 1
    is_70b: bool = False


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


CONDITIONS: dict[str, Callable[[Layer], bool]] = {
    "always": lambda _: True,
    "more_bits": lambda at: use_more_bits(at.index, at.count),
    "first_2": lambda at: at.index < 2,
    "first_4": lambda at: at.index < 4,
    "first_eighth": lambda at: at.index < at.count // 8,
    "first_sixteenth": lambda at: at.index < at.count // 16,
    "gqa_4": lambda at: at.gqa >= 4,
}
Rules = tuple[tuple[str, str], ...]  # (condition, type), first match wins


@dataclass(frozen=True, slots=True)
class Mix:
    name: str
    base: str  # llama_ftype_get_default_type
    rules: dict[str, Rules] = field(default_factory=dict)  # category -> rules
    description: str = ""

    @property
    def file_type(self) -> gguf.LlamaFileType:
        return gguf.LlamaFileType[f"MOSTLY_{self.name}"]


MIXES: dict[str, Mix] = {
    m.name: m
    for m in (
        Mix(
            "Q2_K",
            "Q2_K",
            {
                ATTN_V: (("gqa_4", "Q4_K"), ("always", "Q3_K")),
                FFN_DOWN: (("always", "Q3_K"),),
                ATTN_OUTPUT: (("always", "Q3_K"),),
            },
            "2-bit K-quant; attn_v, ffn_down and attn_output at 3 bits (attn_v 4 with 4+ query heads per KV head)",
        ),
        Mix("Q3_K_S", "Q3_K", {}, "3-bit K-quant everywhere"),
        Mix(
            "Q3_K_M",
            "Q3_K",
            {
                ATTN_V: (("first_2", "Q5_K"), ("always", "Q4_K")),
                FFN_DOWN: (("first_sixteenth", "Q5_K"), ("always", "Q4_K")),
                ATTN_OUTPUT: (("always", "Q4_K"),),
            },
            "3-bit K-quant; attn_v, ffn_down, attn_output at 4 bits (5 in the first layers)",
        ),
        Mix(
            "Q3_K_L",
            "Q3_K",
            {
                ATTN_V: (("always", "Q5_K"),),
                FFN_DOWN: (("always", "Q5_K"),),
                ATTN_OUTPUT: (("always", "Q5_K"),),
            },
            "3-bit K-quant; attn_v, ffn_down, attn_output at 5 bits",
        ),
        Mix(
            "Q4_K_S",
            "Q4_K",
            {
                ATTN_V: (("first_4", "Q5_K"),),
                FFN_DOWN: (("first_eighth", "Q5_K"),),
            },
            "4-bit K-quant; attn_v of the first 4 layers and ffn_down of the first eighth at 5 bits",
        ),
        Mix(
            "Q4_K_M",
            "Q4_K",
            {
                ATTN_V: (("more_bits", "Q6_K"),),
                FFN_DOWN: (("more_bits", "Q6_K"),),
            },
            "4-bit K-quant; attn_v and ffn_down at 6 bits in half the layers (use_more_bits)",
        ),
        Mix("Q5_K_S", "Q5_K", {}, "5-bit K-quant everywhere"),
        Mix(
            "Q5_K_M",
            "Q5_K",
            {
                ATTN_V: (("more_bits", "Q6_K"),),
                FFN_DOWN: (("more_bits", "Q6_K"),),
            },
            "5-bit K-quant; attn_v and ffn_down at 6 bits in half the layers (use_more_bits)",
        ),
        Mix("Q6_K", "Q6_K", {}, "6-bit K-quant everywhere"),
        Mix("Q8_0", "Q8_0", {}, "8-bit blocks of 32 everywhere"),
        Mix("Q4_0", "Q4_0", {}, "4-bit blocks of 32 everywhere (llama.cpp's imatrix-only ffn_down rule not applied)"),
    )
}
# llama.cpp's fallback for a row length its block does not divide (tensor_type_fallback)
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


@dataclass(frozen=True, slots=True)
class TypeChoice:
    """A tensor's type: what the mix asks for and what it gets after the row-length fallback."""

    wanted: str
    type: str

    @property
    def fell_back(self) -> bool:
        return self.wanted != self.type


def mix_of(name: str) -> Mix:
    mix = MIXES.get(name.upper())
    if mix is None:
        raise QuantkitError(f"unknown GGUF mix '{name}'; use one of {', '.join(MIXES)} (e.g. --format gguf:Q4_K_M)")
    return mix


def block_size(type_name: str) -> int:
    return gguf.GGML_QUANT_SIZES[QType[type_name]][0]


def fitted(type_name: str, row: int) -> TypeChoice:
    """``type_name`` for a row of ``row`` weights, with llama.cpp's fallback when its block does not divide it."""
    if row % block_size(type_name) == 0:
        return TypeChoice(type_name, type_name)
    fallback = FALLBACK.get(type_name, type_name)
    return TypeChoice(type_name, fallback if row % block_size(fallback) == 0 else F16)


def category(gguf_name: str) -> str:
    """llama.cpp's tensor_get_category, on GGUF tensor names."""
    if gguf_name == "output.weight":
        return OUTPUT
    if gguf_name == "token_embd.weight":
        return TOKEN_EMBD
    for key in (ATTN_V, ATTN_K, ATTN_Q, ATTN_OUTPUT):
        if f"{key}.weight" in gguf_name:
            return key
    return next((key for key in (FFN_UP, FFN_GATE, FFN_DOWN) if key in gguf_name), OTHER)


def is_quantized(gguf_name: str, dims: int) -> bool:
    """llama.cpp's tensor_allows_quantization for dense decoders: 2-D weights other than norms."""
    return dims == 2 and gguf_name.endswith("weight") and "_norm.weight" not in gguf_name


def tensor_type(mix: Mix, gguf_name: str, row: int, at: Layer, *, tied: bool, has_imatrix: bool = False) -> TypeChoice:
    """The type llama.cpp's quantize gives tensor ``gguf_name`` (row length ``row``) under ``mix``."""
    kind = category(gguf_name)
    wanted = mix.base
    if kind == OUTPUT or (tied and kind == TOKEN_EMBD):
        if row % block_size(mix.base) != 0 or mix.base == "Q8_0":
            return TypeChoice("Q8_0", "Q8_0") if row % 32 == 0 else fitted("Q8_0", row)
        return fitted("Q6_K", row)
    for condition, type_name in mix.rules.get(kind, ()):
        if CONDITIONS[condition](at):
            wanted = type_name
            break
    if kind == ATTN_V and at.is_70b and wanted in ("Q3_K", "Q4_K"):
        wanted = "Q5_K"
    if kind == FFN_DOWN and mix.name == "Q4_0" and has_imatrix and at.index < at.count // 8:
        wanted = "Q4_1"
    return fitted(wanted, row)


def mixes_markdown() -> str:
    """The mixes as a markdown table (docs/formats.md carries it; tools/render_docs.py keeps it current)."""
    lines = ["| mix | base type | rules (before the row-length fallback) |", "|---|---|---|"]
    for mix in MIXES.values():
        words = "; ".join(
            f"{kind}: " + ", ".join(f"{t} if {c}" if c != "always" else t for c, t in rules)
            for kind, rules in mix.rules.items()
        )
        lines.append(f"| `{mix.name}` | {mix.base} | {words or 'none'} |")
    fallbacks = ", ".join(f"{k} -> {v}" for k, v in FALLBACK.items())
    lines += ["", f"Row-length fallbacks: {fallbacks}; F16 when 32 does not divide the row either."]
    return "\n".join(lines)


def default_model_markdown(layers: int = 30, hidden: int = 576, intermediate: int = 1536, gqa: int = 3) -> str:
    """Which type each tensor of the default model (SmolLM2-135M: tied embeddings) gets under each mix."""
    kinds = [("token_embd", hidden), ("attn_q", hidden), ("attn_k", hidden), ("attn_v", hidden)]
    kinds += [("attn_output", hidden), ("ffn_gate", hidden), ("ffn_up", hidden), ("ffn_down", intermediate)]
    lines = ["| mix | " + " | ".join(k for k, _ in kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    for mix in MIXES.values():
        cells = []
        for kind, row in kinds:
            counts: dict[str, int] = {}
            for i in range(layers if kind != "token_embd" else 1):
                name = f"{kind}.weight" if kind == "token_embd" else f"blk.{i}.{kind}.weight"
                t = tensor_type(mix, name, row, Layer(i, layers, gqa), tied=True).type
                counts[t] = counts.get(t, 0) + 1
            cells.append(", ".join(t if len(counts) == 1 else f"{t} x{n}" for t, n in counts.items()))
        lines.append(f"| `{mix.name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
