"""What the engines accept for the weights outside the decoder blocks: a quantized head (``lm_head``) and a quantized
embedding (``embed_tokens``). The one table of those rules; docs/formats.md renders it (tools/render_docs.py).

Sources (read 2026-11):

- compressed-tensors 0.20 ``quantization/lifecycle/apply.py`` and ``initialize.py``: a config group's targets may
  reach ``torch.nn.Linear`` and ``torch.nn.Embedding`` modules (by exact name, ``re:`` regex or class name; an exact
  name wins over a class name, ``utils/match.py``). The head is a Linear: a group targeting ``lm_head`` and an
  ``ignore`` list without it quantize it with that group's scheme. ``Linear`` does not match an Embedding.
- transformers 5.22 loads compressed-tensors checkpoints through that package: a quantized ``lm_head`` loads and
  decompresses like any Linear (tests/quantization/test_head_quant.py loads one and compares the logits).
- vLLM's ``compressed_tensors.py`` (main, late 2026; not in the releases before ``compressed_tensors_embedding.py``
  landed): a ``ParallelLMHead`` whose name a group targets gets ``CompressedTensorsLinearMethod`` (any scheme a
  Linear takes); a ``VocabParallelEmbedding`` gets ``CompressedTensorsEmbeddingWNA16Int`` only for weight-only,
  symmetric INT weights per channel or in groups (anything else: "compressed-tensors embeddings only support
  weight-only INT group/channel (WNA16) quantization"), and that method does lookups only (its ``apply`` raises).
  With tied embeddings vLLM's head *is* the embedding module, so a tied head cannot be quantized.
- transformers 5.22 does not load a packed embedding: ``PreTrainedModel._init_weights`` reads an Embedding's
  ``weight`` unguarded (it guards a Linear's), and compressed-tensors has replaced it by ``weight_packed`` /
  ``weight_scale`` (tests/quantization/test_embed_quant.py asserts the error, so a release that loads it shows).
  It loads an unpacked one: a config group whose ``format`` is ``naive-quantized`` (compressed-tensors 0.20 takes a
  group's own format over the one it infers) keeps ``weight`` itself, as int8 codes, beside ``weight_scale``, and
  compressed-tensors dequantizes it (tests/quantization/test_embed_layout.py compares the logits). vLLM's embedding
  method registers ``weight_packed`` whatever the group's format, so it cannot read the unpacked one.
- quantkit's loader and runtime load a quantized head (a Linear) and a quantized plain embedding (dequantized once).
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.format.engines import Support
from quantkit.format.scheme import QuantScheme

HEAD, EMBEDDING = "lm_head", "embed_tokens"


@dataclass(frozen=True)
class OuterRule:
    module: str
    engine: str
    loads: str  # what the engine loads quantized, in words


RULES: tuple[OuterRule, ...] = (
    OuterRule(HEAD, "compressed-tensors 0.20 / transformers 5.22", "any Linear scheme, in a group naming lm_head"),
    OuterRule(HEAD, "vLLM (main, late 2026)", "any Linear scheme (ParallelLMHead through the Linear method)"),
    OuterRule(HEAD, "quantkit loader and runtime", "any Linear scheme"),
    OuterRule(HEAD, "every engine, tied head", "no: the head is the embedding; untie it (--rotate hadamard) first"),
    OuterRule(EMBEDDING, "compressed-tensors 0.20", "targeted by name (not by Linear); a group may set its format"),
    OuterRule(
        EMBEDDING,
        "transformers 5.22",
        "unpacked int8 (--embedding-layout unpacked: naive-quantized, int8 codes as embed_tokens.weight); not "
        "packed: its weight init reads embed_tokens.weight, which packing replaces (AttributeError at load)",
    ),
    OuterRule(
        EMBEDDING,
        "vLLM (main, late 2026)",
        "packed symmetric INT, per channel or grouped, weight-only (lookup); not unpacked",
    ),
    OuterRule(EMBEDDING, "quantkit loader and runtime", "symmetric INT, packed or unpacked (dequantized once at load)"),
)


def head_problem(scheme: QuantScheme, tied: bool) -> str | None:
    """Why no engine loads this quantized head; None when they all do."""
    if tied:
        return "the head is tied to the embedding (quantizing it changes the embedding too)"
    return None


def embedding_problem(scheme: QuantScheme) -> str | None:
    """Why no engine beyond quantkit loads this quantized embedding; None when vLLM (packed) or transformers
    (unpacked int8) does."""
    if scheme.unpacked:
        return None  # QuantScheme admits unpacked codes for symmetric int8 weights only: transformers loads them
    if scheme.is_float or not scheme.symmetric or scheme.activations is not None or scheme.group_size == 0:
        return "vLLM quantizes embeddings as symmetric INT weights per channel or in groups only"
    return None


def transformers_embedding(scheme: QuantScheme) -> Support:
    """transformers 5.22's verdict on a quantized embedding (``inspect``'s "Loads in" table)."""
    if scheme.unpacked:
        return Support("unpacked int8")
    return Support(
        None, "a packed embedding (transformers 5.22 loads an unpacked int8 one: --embedding-layout unpacked)"
    )


def vllm_embedding(scheme: QuantScheme) -> Support:
    """vLLM main's verdict on a quantized embedding (``inspect``'s "Loads in" table)."""
    if scheme.unpacked:
        return Support(None, "unpacked; vLLM reads embed_tokens.weight_packed")
    problem = embedding_problem(scheme)
    return Support("packed, lookup") if problem is None else Support(None, problem)


def outer_markdown() -> str:
    """The rules as a markdown table (docs/formats.md)."""
    lines = ["| module | engine | loads quantized |", "|---|---|---|"]
    lines += [f"| `{rule.module}` | {rule.engine} | {rule.loads} |" for rule in RULES]
    return "\n".join(lines)
