"""compressed-tensors ``pack-quantized`` checkpoints: per-Linear tensors, quantization_config, sharded writer.

Tensors of one quantized Linear (N out, K in, G groups, b bits), named ``<prefix>.<name>``:

- ``weight_packed``      int32 [N, ceil(K*b/32)]   q packed along K (see :mod:`quantkit.pack`)
- ``weight_scale``       storage dtype [N, G]      ([N, 1] per-channel)
- ``weight_zero_point``  int32 [ceil(N*b/32), G]   asymmetric only; zero points packed along N (dim 0)
- ``weight_shape``       int64 [2]                 (N, K)
- ``weight_g_idx``       int32 [K]                 act-order without static groups only

Target matching follows compressed-tensors: a target is a class name (any class in the module's MRO), an
exact module name, or ``re:<pattern>`` matched with ``re.match`` (anchored at the start only). ``ignore``
uses the same rules. When several targets match, exact names win over regexes, regexes over class
names, ties broken by the target string's sort order; a target listed in several groups belongs to the
last of them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors.torch import save_file

from quantkit.errors import QuantkitError
from quantkit.pack import pack_int32, packed_words, unpack_int32
from quantkit.scheme import SUPPORTED_BITS, QuantizedWeight, QuantScheme

QUANT_METHOD = "compressed-tensors"
PACK_FORMAT = "pack-quantized"
SAFETENSORS_METADATA = {"format": "pt"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

PACKED = "weight_packed"
SCALE = "weight_scale"
ZERO = "weight_zero_point"
SHAPE = "weight_shape"
G_IDX = "weight_g_idx"


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def records_g_idx(scheme: QuantScheme) -> bool:
    """Act-order without static groups: column groups are not contiguous, so ``g_idx`` is stored."""
    return scheme.act_order and not scheme.static_groups


# --------------------------------------------------------------------------------------------------
# Per-Linear tensors
# --------------------------------------------------------------------------------------------------


def linear_tensors(prefix: str, qw: QuantizedWeight, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one quantized Linear (names prefixed with ``prefix.``)."""
    scheme = qw.scheme
    n, k = qw.shape
    if tuple(qw.scale.shape) != (n, scheme.num_groups(k)):
        raise QuantkitError(
            f"{prefix}: scale shape {tuple(qw.scale.shape)} does not match {scheme.name} on a [{n}, {k}] weight; "
            f"expected [{n}, {scheme.num_groups(k)}]"
        )
    if (qw.zero is None) != scheme.symmetric:
        raise QuantkitError(
            f"{prefix}: zero points must be given exactly when the scheme is asymmetric ({scheme.name})"
        )
    if qw.g_idx is not None and not records_g_idx(scheme):
        raise QuantkitError(f"{prefix}: a g_idx can only be stored with act-order without static groups")

    out = {
        _key(prefix, PACKED): pack_int32(qw.qweight, scheme.bits, dim=1),
        _key(prefix, SCALE): qw.scale.to(scale_dtype).contiguous(),
        _key(prefix, SHAPE): torch.tensor([n, k], dtype=torch.int64),
    }
    if qw.zero is not None:
        out[_key(prefix, ZERO)] = pack_int32(qw.zero, scheme.bits, dim=0)
    if records_g_idx(scheme):
        out[_key(prefix, G_IDX)] = qw.column_groups().to(torch.int32).contiguous()
    return out


def _get(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise QuantkitError(f"checkpoint tensor {key!r} is missing; the checkpoint is incomplete, re-export it")
    return tensors[key]


def _expect_shape(key: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
    if tuple(tensor.shape) != shape or (dtype is not None and tensor.dtype != dtype):
        want = f"{dtype} {list(shape)}" if dtype is not None else str(list(shape))
        raise QuantkitError(
            f"checkpoint tensor {key!r} is {tensor.dtype} {list(tensor.shape)}, expected {want}; "
            "the checkpoint does not match its quantization_config"
        )


def read_linear(tensors: Mapping[str, torch.Tensor], prefix: str, scheme: QuantScheme) -> QuantizedWeight:
    """Inverse of :func:`linear_tensors`: the integer weight of one Linear (scales as float32)."""
    shape = _get(tensors, _key(prefix, SHAPE))
    if shape.numel() != 2:
        raise QuantkitError(f"{_key(prefix, SHAPE)!r} must hold 2 values (out, in), got {shape.tolist()}")
    n, k = (int(v) for v in shape.tolist())
    bits, groups = scheme.bits, scheme.num_groups(k)

    packed = _get(tensors, _key(prefix, PACKED))
    _expect_shape(_key(prefix, PACKED), packed, (n, packed_words(k, bits)), torch.int32)
    scale = _get(tensors, _key(prefix, SCALE))
    _expect_shape(_key(prefix, SCALE), scale, (n, groups))
    zero = None
    if not scheme.symmetric:
        zp = _get(tensors, _key(prefix, ZERO))
        _expect_shape(_key(prefix, ZERO), zp, (packed_words(n, bits), groups), torch.int32)
        zero = unpack_int32(zp, bits, n, dim=0)
    g_idx = None
    if records_g_idx(scheme):
        g_idx = _get(tensors, _key(prefix, G_IDX))
        _expect_shape(_key(prefix, G_IDX), g_idx, (k,))
        g_idx = g_idx.to(torch.int32)
        if k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise QuantkitError(f"{_key(prefix, G_IDX)!r} holds group indices outside [0, {groups})")
    qweight = unpack_int32(packed, bits, k, dim=1)
    return QuantizedWeight(qweight=qweight, scale=scale.float(), zero=zero, g_idx=g_idx, scheme=scheme)


# --------------------------------------------------------------------------------------------------
# quantization_config
# --------------------------------------------------------------------------------------------------


def _actorder(scheme: QuantScheme) -> str | None:
    if not scheme.act_order:
        return None
    return "weight" if scheme.static_groups else "group"


def _weights_args(scheme: QuantScheme) -> dict[str, Any]:
    return {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "strategy": "channel" if scheme.per_channel else "group",
        "group_size": None if scheme.per_channel else scheme.group_size,
        "actorder": _actorder(scheme),
        "dynamic": False,
        "observer": "mse" if scheme.mse_clip else "minmax",
    }


def build_quantization_config(groups: list[tuple[QuantScheme, list[str]]], ignore: list[str]) -> dict[str, Any]:
    """``quantization_config`` for config.json; one config group per (scheme, targets) pair, in order.

    Later groups win when the same target string appears twice (compressed-tensors semantics), so prefer
    disjoint targets: e.g. ``["Linear"]`` for the default scheme plus ``["re:.*down_proj$"]`` overrides.
    """
    if not groups:
        raise QuantkitError("no quantized layers: give at least one (scheme, targets) group")
    config_groups: dict[str, Any] = {}
    for i, (scheme, targets) in enumerate(groups):
        if not targets:
            raise QuantkitError(f"group {i} ({scheme.name}) has no targets; use 'Linear' or 're:<module regex>'")
        for target in targets:
            _check_target(target)
        config_groups[f"group_{i}"] = {
            "targets": list(targets),
            "weights": _weights_args(scheme),
            "input_activations": None,
            "output_activations": None,
            "format": PACK_FORMAT,
        }
    for target in ignore:
        _check_target(target)
    return {
        "quant_method": QUANT_METHOD,
        "format": PACK_FORMAT,
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }


def _check_target(target: str) -> None:
    if target.startswith("re:"):
        try:
            re.compile(target[3:])
        except re.error as exc:
            raise QuantkitError(f"target {target!r} is not a valid regular expression: {exc}") from exc
    elif not target:
        raise QuantkitError("empty target; use a class name such as 'Linear', a module name, or 're:<regex>'")


def _match_name(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _class_names(class_name: str | Iterable[str]) -> tuple[str, ...]:
    names = (class_name,) if isinstance(class_name, str) else tuple(class_name)
    # compressed-tensors lets target "Linear" match vLLM's LinearBase
    return (*names, "Linear") if "LinearBase" in names else names


@dataclass(slots=True, frozen=True)
class QuantizationLayout:
    """Parsed ``quantization_config``: which scheme each module gets."""

    target_schemes: dict[str, QuantScheme]  # target -> scheme (last group wins, config order kept)
    ignore: tuple[str, ...] = ()
    groups: tuple[tuple[QuantScheme, tuple[str, ...]], ...] = field(default=())

    def is_ignored(self, module_name: str, class_name: str | Iterable[str] = "Linear") -> bool:
        classes = _class_names(class_name)
        return any(_match_name(module_name, t) or t in classes for t in self.ignore)

    def scheme_for(self, module_name: str, class_name: str | Iterable[str] = "Linear") -> QuantScheme | None:
        """Scheme of a module (``class_name``: its class, or all class names of its MRO), None if unquantized."""
        classes = _class_names(class_name)
        if self.is_ignored(module_name, classes):
            return None
        ordered = sorted(self.target_schemes, key=lambda t: ("re:" in t, t))
        by_name = [t for t in ordered if _match_name(module_name, t)]
        by_class = [t for t in ordered if t in classes and t not in by_name]
        matched = by_name + by_class
        return self.target_schemes[matched[0]] if matched else None

    @property
    def schemes(self) -> list[QuantScheme]:
        return [scheme for scheme, _ in self.groups]


def _unsupported(what: str) -> QuantkitError:
    return QuantkitError(
        f"unsupported quantization_config: {what}; quantkit reads compressed-tensors 'pack-quantized' "
        "checkpoints with int weight-only quantization (group or channel strategy)"
    )


def _scheme_from_args(group: str, args: Mapping[str, Any]) -> QuantScheme:
    if str(args.get("type", "int")).lower() != "int":
        raise _unsupported(f"{group} quantizes weights to type {args.get('type')!r}")
    if args.get("dynamic", False):
        raise _unsupported(f"{group} uses dynamic weight quantization")
    bits = int(args.get("num_bits", 8))
    if bits not in SUPPORTED_BITS:
        raise _unsupported(f"{group} uses {bits}-bit weights (supported: {list(SUPPORTED_BITS)})")
    group_size = args.get("group_size")
    strategy = args.get("strategy") or ("channel" if group_size == -1 else "group" if group_size else "tensor")
    strategy = str(strategy).lower()
    if strategy == "channel":
        group_size = -1
    elif strategy != "group" or not group_size or group_size <= 0:
        raise _unsupported(f"{group} uses strategy {strategy!r} with group_size {group_size!r}")
    actorder = args.get("actorder")
    actorder = str(actorder).lower() if actorder not in (None, False) else None
    if actorder not in (None, "group", "dynamic", "weight", "static"):
        raise _unsupported(f"{group} uses actorder {args.get('actorder')!r}")
    return QuantScheme(
        bits=bits,
        group_size=int(group_size),
        symmetric=bool(args.get("symmetric", True)),
        act_order=actorder is not None,
        static_groups=actorder in ("weight", "static"),
        mse_clip=args.get("observer") == "mse",
    )


def parse_quantization_config(cfg: Mapping[str, Any]) -> QuantizationLayout:
    """Read a compressed-tensors ``quantization_config`` dict; QuantkitError for what quantkit cannot load."""
    if cfg.get("quant_method") != QUANT_METHOD:
        raise _unsupported(f"quant_method is {cfg.get('quant_method')!r}, not {QUANT_METHOD!r}")
    if cfg.get("format") != PACK_FORMAT:
        raise _unsupported(f"format is {cfg.get('format')!r}, not {PACK_FORMAT!r}")
    if cfg.get("quantization_status", "compressed") != "compressed":
        raise _unsupported(f"quantization_status is {cfg.get('quantization_status')!r}, not 'compressed'")
    if cfg.get("kv_cache_scheme"):
        raise _unsupported("kv-cache quantization")
    if cfg.get("transform_config"):
        raise _unsupported("transforms (transform_config)")
    raw_groups = cfg.get("config_groups") or {}
    if not raw_groups:
        raise _unsupported("config_groups is empty")
    target_schemes: dict[str, QuantScheme] = {}
    groups: list[tuple[QuantScheme, tuple[str, ...]]] = []
    for name, group in raw_groups.items():
        if not isinstance(group, Mapping):
            raise _unsupported(f"{name} is a preset reference ({group!r}); write the scheme out in full")
        if group.get("input_activations") or group.get("output_activations"):
            raise _unsupported(f"{name} quantizes activations")
        if group.get("format") not in (None, PACK_FORMAT):
            raise _unsupported(f"{name} has format {group.get('format')!r}")
        if not group.get("weights"):
            raise _unsupported(f"{name} has no weight quantization")
        targets = tuple(group.get("targets") or ())
        if not targets:
            raise _unsupported(f"{name} has no targets")
        scheme = _scheme_from_args(name, group["weights"])
        for target in targets:
            _check_target(target)
            target_schemes.pop(target, None)  # keep config order, last group wins
            target_schemes[target] = scheme
        groups.append((scheme, targets))
    ignore = tuple(cfg.get("ignore") or ())
    return QuantizationLayout(target_schemes=target_schemes, ignore=ignore, groups=tuple(groups))


# --------------------------------------------------------------------------------------------------
# Sharded, atomic writer
# --------------------------------------------------------------------------------------------------


def _shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


class ShardedWriter:
    """Write a checkpoint as safetensors shards into ``<final>.tmp-<pid>``, then rename it into place.

    Use as a context manager: an exception (or leaving without :meth:`finalize`) removes the temp dir.
    """

    def __init__(self, final_dir: Path, max_shard_bytes: int = 2 * 1024**3, overwrite: bool = False) -> None:
        if max_shard_bytes <= 0:
            raise QuantkitError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.final_dir = Path(final_dir)
        self.max_shard_bytes = max_shard_bytes
        self.overwrite = overwrite
        self.tmp_dir = self.final_dir.with_name(f"{self.final_dir.name}.tmp-{os.getpid()}")
        self._check_destination()
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)  # left over by a crashed run with the same pid
        self.tmp_dir.mkdir(parents=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names per flushed shard
        self._names: set[str] = set()
        self._total_bytes = 0
        self._done = False

    def _check_destination(self) -> None:
        if self.final_dir.exists() and not self.overwrite:
            raise QuantkitError(
                f"output directory {self.final_dir} already exists; choose another path or pass overwrite=True"
            )

    def add(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Queue tensors; full shards are flushed to disk as they fill."""
        if self._done:
            raise RuntimeError("ShardedWriter.add() after finalize()/abort()")
        for name, tensor in tensors.items():
            if name in self._names:
                raise QuantkitError(f"tensor {name!r} was added twice")
            nbytes = tensor.numel() * tensor.element_size()
            if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
                self._flush()
            self._names.add(name)
            self._pending[name] = self._owned(tensor)
            self._pending_bytes += nbytes
            self._total_bytes += nbytes

    def _owned(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU tensor that shares no storage with the other queued tensors."""
        t = tensor.detach().to("cpu").contiguous()
        shares = t.untyped_storage().nbytes() != t.numel() * t.element_size()
        if shares or any(
            p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for p in self._pending.values()
        ):
            t = t.clone()
        return t

    def _flush(self) -> None:
        if not self._pending:
            return
        index = len(self._shards)
        save_file(self._pending, str(self.tmp_dir / f"shard-{index:05d}.tmp"), metadata=SAFETENSORS_METADATA)
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finalize(
        self,
        config: Mapping[str, Any],
        copy_files: Sequence[Path] = (),
        quantization_config: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write the last shard, index, config.json (plus ``quantization_config`` if given) and copied files."""
        if self._done:
            raise RuntimeError("ShardedWriter.finalize() called twice or after abort()")
        self._flush()
        if not self._shards:
            raise QuantkitError("nothing to write: no tensors were added")
        self._name_shards()
        cfg = dict(config)
        if quantization_config is not None:
            cfg["quantization_config"] = dict(quantization_config)
        (self.tmp_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for src in copy_files:
            src = Path(src)
            if src.name in ("config.json", SINGLE_FILE, INDEX_FILE) or src.suffix == ".safetensors":
                raise QuantkitError(
                    f"{src.name} would overwrite a checkpoint file; copy tokenizer/generation files only"
                )
            shutil.copy2(src, self.tmp_dir / src.name)
        self._move_into_place()
        self._done = True
        return self.final_dir

    def _name_shards(self) -> None:
        n = len(self._shards)
        if n == 1:
            (self.tmp_dir / "shard-00000.tmp").rename(self.tmp_dir / SINGLE_FILE)
            return
        weight_map: dict[str, str] = {}
        for i, names in enumerate(self._shards):
            final = _shard_name(i + 1, n)
            (self.tmp_dir / f"shard-{i:05d}.tmp").rename(self.tmp_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self._total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.tmp_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    def _move_into_place(self) -> None:
        self._check_destination()
        if not self.final_dir.exists():
            self.tmp_dir.rename(self.final_dir)
            return
        # overwrite: swap the complete new dir in, then delete the old one
        old = self.final_dir.with_name(f"{self.final_dir.name}.old-{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        self.final_dir.rename(old)
        try:
            self.tmp_dir.rename(self.final_dir)
        except OSError:
            old.rename(self.final_dir)
            raise
        shutil.rmtree(old)

    def abort(self) -> None:
        """Discard everything written so far (the final dir is never touched)."""
        self._done = True
        self._pending = {}
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._done:
            return
        self.abort()
        if exc_type is None:
            raise QuantkitError("ShardedWriter closed without finalize(); nothing was written")


# --------------------------------------------------------------------------------------------------
# Whole-model export
# --------------------------------------------------------------------------------------------------


def _check_layout(model: torch.nn.Module, quantized: Mapping[str, QuantizedWeight], layout: QuantizationLayout) -> None:
    """Every quantized Linear has the scheme the config gives it, and every targeted Linear is quantized."""
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            if name in quantized:
                raise QuantkitError(f"{name!r} is not a Linear of this model")
            continue
        scheme = layout.scheme_for(name, [c.__name__ for c in type(module).__mro__])
        if name in quantized and scheme != quantized[name].scheme:
            raise QuantkitError(
                f"{name!r} was quantized with {quantized[name].scheme.name} but quantization_config gives it "
                f"{scheme.name if scheme else 'no scheme'}; fix the config targets"
            )
        if name not in quantized and scheme is not None:
            raise QuantkitError(f"quantization_config targets {name!r} but no quantized weight was given for it")
    unknown = set(quantized) - {name for name, _ in model.named_modules()}
    if unknown:
        raise QuantkitError(f"quantized weights given for modules this model does not have: {sorted(unknown)}")


def save_quantized_model(
    model: torch.nn.Module,
    quantized: Mapping[str, QuantizedWeight],
    quantization_config: Mapping[str, Any],
    out_dir: Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    copy_files: Sequence[Path] = (),
    max_shard_bytes: int = 2 * 1024**3,
    overwrite: bool = False,
) -> Path:
    """Export ``model`` with the Linears named in ``quantized`` replaced by packed tensors.

    Float tensors and scales are stored in ``dtype``. Every quantized module must be the one
    ``quantization_config`` assigns its scheme to (checked), and tied weights are written once.
    """
    _check_layout(model, quantized, parse_quantization_config(quantization_config))

    config = model.config.to_dict() if hasattr(model, "config") else {}
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    config.pop("quantization_config", None)
    skip = {f"{name}.weight" for name in quantized}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    with ShardedWriter(out_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite) as writer:
        for key, tensor in model.state_dict(keep_vars=False).items():
            if key in skip:
                continue
            ident = (tensor.data_ptr(), tuple(tensor.shape))
            if ident in seen and tensor.numel():  # tied weight: stored once, under its first name
                continue
            seen.add(ident)
            writer.add({key: tensor.to(dtype) if tensor.is_floating_point() else tensor})
        for name, qw in quantized.items():
            writer.add(linear_tensors(name, qw, dtype))
        return writer.finalize(config, copy_files, quantization_config)
