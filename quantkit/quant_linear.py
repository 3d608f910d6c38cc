"""QuantLinear (dequantize-on-the-fly Linear over checkpoint tensors) and loading quantized checkpoints."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from quantkit.checkpoint import (
    G_IDX,
    INDEX_FILE,
    PACKED,
    SCALE,
    SHAPE,
    SINGLE_FILE,
    ZERO,
    QuantizationLayout,
    linear_tensors,
    parse_quantization_config,
    read_linear,
    records_g_idx,
)
from quantkit.errors import QuantkitError
from quantkit.pack import packed_words
from quantkit.scheme import QuantizedWeight, QuantScheme

_MAX_LISTED = 8


class QuantLinear(nn.Module):
    """A Linear whose weight is held as compressed-tensors ``pack-quantized`` buffers.

    The buffers are named like the checkpoint tensors, so ``load_state_dict`` takes a checkpoint's
    tensors directly. ``forward`` unpacks and dequantizes the weight on every call (plain torch);
    set ``cache_weight=True`` to keep the dense weight after the first call (uses dense memory).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: QuantScheme,
        bias: bool = False,
        scale_dtype: torch.dtype = torch.bfloat16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        cache_weight: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.cache_weight = cache_weight
        self._cached: torch.Tensor | None = None
        n, k, bits, groups = out_features, in_features, scheme.bits, scheme.num_groups(in_features)
        kw = {"device": device}
        self.register_buffer(PACKED, torch.zeros(n, packed_words(k, bits), dtype=torch.int32, **kw))
        self.register_buffer(SCALE, torch.ones(n, groups, dtype=scale_dtype, **kw))
        if not scheme.symmetric:
            self.register_buffer(ZERO, torch.zeros(packed_words(n, bits), groups, dtype=torch.int32, **kw))
        self.register_buffer(SHAPE, torch.tensor([n, k], dtype=torch.int64, device=device))
        if records_g_idx(scheme):
            self.register_buffer(G_IDX, torch.zeros(k, dtype=torch.int32, **kw))
        self.bias = nn.Parameter(torch.zeros(n, dtype=dtype, **kw), requires_grad=False) if bias else None

    @classmethod
    def from_quantized(
        cls, qw: QuantizedWeight, bias: torch.Tensor | None = None, scale_dtype: torch.dtype = torch.bfloat16
    ) -> QuantLinear:
        """Build from an in-memory quantized weight (scales cast to ``scale_dtype``)."""
        n, k = qw.shape
        dtype = bias.dtype if bias is not None else torch.float32
        layer = cls(k, n, qw.scheme, bias=bias is not None, scale_dtype=scale_dtype, dtype=dtype)
        state = linear_tensors("", qw, scale_dtype)
        if bias is not None:
            state["bias"] = bias.detach().clone()
        layer.load_state_dict(state, strict=True)
        return layer

    def quantized_weight(self) -> QuantizedWeight:
        """The integer weight held by this layer."""
        return read_linear(dict(self.named_buffers(recurse=False)), "", self.scheme)

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized [out, in] weight: ``(q - zero) * scale`` computed exactly in float32, then cast.

        Casting once afterwards equals computing in a 16-bit dtype: the product of a small integer and a
        16-bit scale is exact in float32, so both round once.
        """
        if self._cached is not None and self._cached.dtype == dtype:
            return self._cached
        weight = self.quantized_weight().dequantize(dtype).to(self.weight_packed.device)
        if self.cache_weight:
            self._cached = weight
        return weight

    def clear_cache(self) -> None:
        self._cached = None

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self._cached = None  # new buffers invalidate the dense copy
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.dense_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def read_checkpoint_config(path: Path) -> dict:
    """The parsed config.json of a checkpoint directory."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise QuantkitError(f"{path} has no config.json; point to a checkpoint directory")
    return json.loads(config_path.read_text())


def is_quantized_checkpoint(path: Path) -> bool:
    """True when ``path`` holds a config.json with a compressed-tensors quantization_config."""
    try:
        cfg = read_checkpoint_config(Path(path))
    except (QuantkitError, json.JSONDecodeError, OSError):
        return False
    qc = cfg.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors"


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint (single file or index)."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
    elif (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    else:
        raise QuantkitError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    for f in files:
        if not f.is_file():
            raise QuantkitError(f"shard {f.name} listed in {INDEX_FILE} is missing from {path}")
    return files


def _class_names(module: nn.Module) -> list[str]:
    return [c.__name__ for c in type(module).__mro__]


def replace_linears(
    model: nn.Module,
    layout: QuantizationLayout,
    scale_dtypes: Mapping[str, torch.dtype],
    cache_weight: bool = False,
) -> int:
    """Swap every targeted (not ignored) Linear for a QuantLinear on the meta device; returns the count."""
    count = 0
    for name, module in list(model.named_modules()):
        scheme = layout.scheme_for(name, _class_names(module))
        if scheme is None:
            continue
        if not isinstance(module, nn.Linear):
            if isinstance(module, nn.Embedding):
                raise QuantkitError(f"quantization_config quantizes embedding {name!r}; quantkit loads Linear only")
            continue  # compressed-tensors only quantizes Linear/Embedding; other matches are inert
        parent_name, _, leaf = name.rpartition(".")
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


def _load_tensors(files: Iterable[Path], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All checkpoint tensors; float tensors cast to ``dtype`` except quantization scales."""
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for key, tensor in load_file(str(f)).items():
            keep = key.endswith("." + SCALE) or not tensor.is_floating_point()
            state[key] = tensor if keep else tensor.to(dtype)
    return state


def scale_dtypes(files: Iterable[Path]) -> dict[str, torch.dtype]:
    """The stored dtype of every ``weight_scale`` tensor, read from the safetensors headers."""
    from safetensors import safe_open

    dtypes: dict[str, torch.dtype] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.endswith("." + SCALE):
                    dtypes[key] = handle.get_slice(key).get_dtype()
    return {k: _DTYPES.get(v, torch.bfloat16) for k, v in dtypes.items()}


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


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


def load_quantized_model(path: Path, dtype: torch.dtype = torch.float32, cache_weight: bool = False) -> nn.Module:
    """Load a quantkit / compressed-tensors ``pack-quantized`` checkpoint with QuantLinear layers (CPU).

    Non-quantized float tensors are cast to ``dtype``; scales stay in their stored dtype. ``cache_weight``
    keeps each dense weight after its first use (fast repeated forwards, e.g. evaluation; dense memory).
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
    if replace_linears(model, layout, scale_dtypes(files), cache_weight) == 0:
        raise QuantkitError(f"quantization_config of {path} targets no Linear layer of {type(model).__name__}")

    state = _load_tensors(files, dtype)
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
    return model.eval()
