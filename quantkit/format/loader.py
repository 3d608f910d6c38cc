"""Loading a ``pack-quantized`` checkpoint into a Hugging Face model: built on the meta device, targeted
Linears swapped for :class:`QuantLinear` from the ``quantization_config``, then loaded with ``assign=True``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.format.files import read_checkpoint_config, scale_dtypes, shard_files
from quantkit.format.kv_cache import KV_SCALES, add_kv_scale_buffers, use_fp8_cache
from quantkit.format.quant_embedding import QuantEmbedding, densify_embeddings
from quantkit.format.quant_linear import QuantLinear
from quantkit.format.quantization_config import QuantizationLayout, parse_quantization_config
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import GLOBAL, INPUT_GLOBAL, INPUT_SCALE, SCALE

# scales kept in their stored dtype (a KV cache's k_scale / v_scale too: the runtime reads them as stored)
STORED_SCALES = tuple(f".{name}" for name in (SCALE, GLOBAL, INPUT_SCALE, INPUT_GLOBAL, *KV_SCALES))

_MAX_LISTED = 8


def _class_names(module: nn.Module) -> list[str]:
    return [c.__name__ for c in type(module).__mro__]


def replace_linears(
    model: nn.Module,
    layout: QuantizationLayout,
    scale_dtypes: Mapping[str, torch.dtype],
    cache_weight: bool = False,
) -> int:
    """Swap every targeted (not ignored) Linear for a QuantLinear and a targeted embedding for a QuantEmbedding, on the
    meta device; returns the count."""
    count = 0
    for name, module in list(model.named_modules()):
        scheme = layout.scheme_for(name, _class_names(module))
        if scheme is None:
            continue
        parent_name, _, leaf = name.rpartition(".")
        if isinstance(module, nn.Embedding):
            if scheme.unpacked:
                continue  # stays an Embedding: its int8 codes are dequantized into its weight when loaded
            setattr(model.get_submodule(parent_name), leaf, _quant_embedding(name, module, scheme, scale_dtypes))
            count += 1
            continue
        if not isinstance(module, nn.Linear):
            continue  # compressed-tensors only quantizes Linear/Embedding; other matches are inert
        layer = QuantLinear(
            module.in_features,
            module.out_features,
            scheme,
            bias=module.bias is not None,
            scale_dtype=scale_dtypes.get(f"{name}.{SCALE}", torch.bfloat16),
            device="meta",
            cache_weight=cache_weight,
        )
        setattr(model.get_submodule(parent_name), leaf, layer)
        count += 1
    return count


def _quant_embedding(
    name: str, module: nn.Embedding, scheme: QuantScheme, scale_dtypes: Mapping[str, torch.dtype]
) -> QuantEmbedding:
    """A quantized embedding on the meta device; a subclass (Gemma's scaled embedding) is refused: its forward
    does more than a lookup."""
    if type(module) is not nn.Embedding:
        raise QuantkitError(
            f"quantization_config quantizes embedding {name!r} ({type(module).__name__}); quantkit loads quantized "
            "plain embeddings only"
        )
    scale = scale_dtypes.get(f"{name}.{SCALE}", torch.bfloat16)
    dtype = module.weight.dtype
    return QuantEmbedding(module.num_embeddings, module.embedding_dim, scheme, scale, dtype, device="meta")


def keeps_stored_dtype(key: str, tensor: torch.Tensor) -> bool:
    """Whether a checkpoint tensor is read in its stored dtype: codes (integers, FP8) and quantization scales; the
    rest (dense weights, norms, biases) takes the model's dtype."""
    return not tensor.is_floating_point() or tensor.dtype == torch.float8_e4m3fn or key.endswith(STORED_SCALES)


def _load_tensors(files: Iterable[Path], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All checkpoint tensors; float tensors cast to ``dtype`` except codes and quantization scales."""
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for key, tensor in load_file(str(f)).items():
            state[key] = tensor if keeps_stored_dtype(key, tensor) else tensor.to(dtype)
    return state


def _listed(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - _MAX_LISTED} more)" if len(keys) > _MAX_LISTED else ""
    return ", ".join(keys[:_MAX_LISTED]) + more


def _tied_targets(model: nn.Module, expected: set[str], state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Tied target -> source parameter names whose target the checkpoint omits."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return {t: s for t, s in tied.items() if t in expected and t not in state and s in state}


def _check_keys(expected: set[str], state: Mapping[str, torch.Tensor], tied: Mapping[str, str], path: Path) -> None:
    missing = expected - set(state) - set(tied)
    unexpected = set(state) - expected
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listed(unexpected)}")
    if problems:
        raise QuantkitError(
            f"checkpoint {path} does not match the model its config.json describes ({'; '.join(problems)}); "
            "the checkpoint is incomplete or its quantization_config targets the wrong layers"
        )


def materialize_meta_buffers(model: nn.Module) -> None:
    """Recompute buffers still on meta (non-persistent, e.g. rotary ``inv_freq``) by rebuilding on CPU."""
    for name, module in model.named_modules():
        meta = [b for b, t in module.named_buffers(recurse=False) if t is not None and t.is_meta]
        if not meta:
            continue
        if all(hasattr(module, f"scalar_{b}") for b in meta):
            # a buffer its module also keeps as a Python number (Gemma's embed_scale): the same value, on CPU
            for b in meta:
                module._buffers[b] = torch.tensor(getattr(module, f"scalar_{b}"), dtype=module._buffers[b].dtype)
            continue
        config = getattr(module, "config", None)
        try:
            with torch.device("cpu"):
                fresh = type(module)(config) if config is not None else type(module)()
        except Exception as exc:
            raise QuantkitError(
                f"cannot recompute buffers {meta} of {name or 'the model'} ({type(module).__name__}); "
                "this architecture is not supported by load_quantized_model"
            ) from exc
        for b in meta:
            module._buffers[b] = getattr(fresh, b)


def load_quantized_model(
    path: Path,
    dtype: torch.dtype = torch.float32,
    cache_weight: bool = False,
    prepare: Callable[[nn.Module], object] | None = None,
) -> nn.Module:
    """Load a quantkit / compressed-tensors ``pack-quantized`` checkpoint with QuantLinear layers (CPU).

    Non-quantized float tensors are cast to ``dtype``; scales stay in their stored dtype. ``cache_weight``
    keeps each dense weight after its first use (fast repeated forwards, e.g. evaluation; dense memory).
    ``prepare``: called on the model built from config.json (on the meta device) before its Linear layers are
    replaced, e.g. to give a mixture of experts one Linear per expert projection as the checkpoint stores them.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    raw = read_checkpoint_config(path)
    if "quantization_config" not in raw:
        raise QuantkitError(f"{path}/config.json has no quantization_config; load it as a regular HF model")
    layout = parse_quantization_config(raw["quantization_config"])
    files = shard_files(path)

    config = AutoConfig.from_pretrained(str(path))
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # build a plain model; QuantLinear replaces the targeted layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if prepare is not None:
        prepare(model)
    if replace_linears(model, layout, scale_dtypes(files), cache_weight) == 0:
        raise QuantkitError(f"quantization_config of {path} targets no Linear layer of {type(model).__name__}")
    if layout.kv_cache is not None and add_kv_scale_buffers(model, layout.kv_cache, scale_dtypes(files)) == 0:
        raise QuantkitError(f"{path} names a kv_cache_scheme in its quantization_config but stores no k_scale/v_scale")

    state = _load_tensors(files, dtype)
    densify_embeddings(model, layout, state, unpacked_only=True)
    expected = set(model.state_dict().keys())
    tied = _tied_targets(model, expected, state)
    _check_keys(expected, state, tied, path)
    model.load_state_dict(state, strict=False, assign=True)
    for target, source in tied.items():
        parent, _, leaf = target.rpartition(".")
        setattr(model.get_submodule(parent), leaf, model.get_parameter(source))
    materialize_meta_buffers(model)
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise QuantkitError(f"tensors left uninitialised after loading {path}: {_listed(leftover)}")
    model.config.quantization_config = raw["quantization_config"]
    if layout.kv_cache is not None:  # keys and values through FP8 under the stored scales, as the cache holds them
        use_fp8_cache(model)
    return model.eval()
