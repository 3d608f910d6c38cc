"""The GGUF tensor plan of a float model: every tensor llama.cpp's file holds, its GGUF name and the GGML type the
mix (or an explicit per-tensor choice) gives it, from the safetensors headers alone (before any work).

Names come from gguf-py's ``TensorNameMap``; a tied head is not written (llama.cpp reads token_embd for it, and
the mix then treats token_embd as the output), unless the run unties it (a folded rotation gives the head its own
matrix): then ``output.weight`` is planned with the mix's output type and token_embd gets the type llama.cpp's
quantize gives an untied embedding. Tensors the quantizer does not solve (norms, biases) are F32.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import gguf

from quantkit.errors import QuantkitError
from quantkit.model.architectures import ArchSpec
from quantkit.model.source_weights import SourceWeights, config_json, head_is_tied
from quantkit.quantization.gguf.mixes import Layer, Mix, TypeChoice, fitted, is_quantized, tensor_type

F32 = "F32"
SKIPPED_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")
LINEAR, EMBEDDING, HEAD, DENSE = "linear", "embedding", "head", "dense"  # who produces a tensor's bytes
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(slots=True)
class PlannedTensor:
    hf_name: str
    name: str  # GGUF name
    shape: tuple[int, ...]  # PyTorch order ([N, K] for a matrix)
    choice: TypeChoice  # the GGML type (or F16/F32) wanted and written
    role: str  # LINEAR (solved in the block loop), EMBEDDING, HEAD, or DENSE (copied as F32)

    @property
    def type(self) -> str:
        return self.choice.type

    @property
    def params(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def gguf_arch_of(arch: ArchSpec, model_type: str) -> gguf.MODEL_ARCH:
    if arch.gguf_arch is None:
        raise QuantkitError(
            f"architecture {model_type!r} has no GGUF output; use a Llama, Qwen2 or Qwen3 model, or convert with "
            "llama.cpp's convert_hf_to_gguf.py and quantize with llama-quantize"
        )
    return gguf.MODEL_ARCH[arch.gguf_arch.upper()]


def _layer_of(config: dict[str, Any], gguf_name: str, arch: gguf.MODEL_ARCH) -> Layer:
    n_layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    match = _BLOCK.match(gguf_name)
    is_70b = arch == gguf.MODEL_ARCH.LLAMA and n_layers == 80 and heads != kv  # llama.cpp's LLM_TYPE_70B
    return Layer(int(match.group(1)) if match else 0, n_layers, heads // kv, is_70b)


def plan_gguf(
    weights: SourceWeights, arch: ArchSpec, mix: Mix, types: dict[str, str] | None = None, *, untie_head: bool = False
) -> list[PlannedTensor]:
    """Every GGUF tensor of the model in ``weights``, in file order; ``types`` (HF name -> GGML type) replaces the
    mix's choice for the tensors it names (each still gets llama.cpp's row-length fallback). ``untie_head``: a tied
    head gets an ``output.weight`` of its own (last in the file), as an untied source's would."""
    config = config_json(weights.path)
    model_type = str(config.get("model_type"))
    if arch.moe is not None:
        raise QuantkitError(f"GGUF output supports dense models; '{model_type}' has experts")
    g_arch = gguf_arch_of(arch, model_type)
    names = gguf.get_tensor_name_map(g_arch, int(config["num_hidden_layers"]))
    head = f"{arch.lm_head_path}.weight"
    source_tied = head_is_tied(weights.path, head, weights)
    tied = source_tied and not untie_head  # as llama.cpp's quantize sees the file: no output.weight in it
    plan = []
    for hf_name in weights.names():
        if hf_name.endswith(SKIPPED_SUFFIXES) or (source_tied and hf_name == head):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise QuantkitError(
                f"tensor {hf_name} has no llama.cpp name for arch {gguf.MODEL_ARCH_NAMES[g_arch]}; GGUF output "
                "writes the standard decoder tensors only"
            )
        shape = tuple(weights.shape(hf_name))
        if not is_quantized(name, len(shape)):
            plan.append(PlannedTensor(hf_name, name, shape, TypeChoice(F32, F32), DENSE))
            continue
        if types is not None and hf_name in types:
            choice = fitted(types[hf_name], shape[-1])
        else:
            choice = tensor_type(mix, name, shape[-1], _layer_of(config, name, g_arch), tied=tied)
        plan.append(PlannedTensor(hf_name, name, shape, choice, _role(hf_name, arch, head)))
    if source_tied and untie_head:
        shape = tuple(weights.shape(f"{arch.embed_path}.weight"))
        output = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT] + ".weight"
        choice = tensor_type(mix, output, shape[-1], _layer_of(config, output, g_arch), tied=False)
        if types is not None and head in types:
            choice = fitted(types[head], shape[-1])
        plan.append(PlannedTensor(head, output, shape, choice, HEAD))
    return plan


def _role(hf_name: str, arch: ArchSpec, head: str) -> str:
    if hf_name == f"{arch.embed_path}.weight":
        return EMBEDDING
    if hf_name == head:
        return HEAD
    owner, layers = hf_name.removesuffix(".weight"), f"{arch.layers_path}."
    if owner.startswith(layers) and owner[len(layers) :].partition(".")[2] in arch.linears:
        return LINEAR
    raise QuantkitError(f"{hf_name}: a 2-D weight outside the decoder's linears; GGUF output cannot place it")
