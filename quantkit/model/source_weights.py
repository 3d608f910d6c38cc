"""Lazy access to a model's safetensors shards, and a skeleton model whose blocks are loaded one at a time.

Only the tensors asked for are read, so a model larger than RAM can be processed block by block.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.format.files import shard_files
from quantkit.format.loader import materialize_meta_buffers
from quantkit.format.safetensors_stream import StoredTensor, stored_tensors
from quantkit.model.architectures import ARCHITECTURES
from quantkit.model.gpt_oss import INTERLEAVED, derived_expert_names, derived_shape, expert_part, fused_leaves


class SourceWeights:
    """Tensor name -> shard, read on demand (in the stored dtype).

    A shard is opened (memory-mapped) only while tensors are read from it: mapped pages count as resident
    memory, so keeping every shard open would make a pass over the model hold all of it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files = shard_files(path)
        self._stored: dict[str, StoredTensor] = {}  # where each tensor's bytes are, from the shard headers
        for f in self.files:
            self._stored.update(stored_tensors(f))
        self._where: dict[str, Path] = {name: t.path for name, t in self._stored.items()}
        # per-expert tensors of a family whose files hold fused experts (gpt_oss), derived from them when read
        self._shapes = {name: t.shape for name, t in self._stored.items()}
        self._derived = _derived_experts(path, self._shapes)
        owners = {owner for owner, *_ in self._derived.values()}
        self._fused_leaves = {owner: fused_leaves(owner, self._stored) for owner in owners}
        self._fused = {f"{owner}.{leaf}" for owner, leaves in self._fused_leaves.items() for leaf in leaves}

    def __enter__(self) -> SourceWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def names(self) -> list[str]:
        """Every tensor by the name the model reads it under (per-expert names in place of fused experts)."""
        return [name for name in self._where if name not in self._fused] + list(self._derived)

    def __contains__(self, name: str) -> bool:
        return name in self._where or name in self._derived

    def get(self, name: str) -> torch.Tensor:
        return self.get_many([name])[name]

    def get_many(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Several tensors, opening each shard involved once."""
        derived = [n for n in names if n in self._derived]
        if derived:
            return self._read([n for n in names if n not in self._derived]) | self._derive(derived)
        return self._read(names)

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        missing = [n for n in names if n not in self._where]
        if missing:
            raise QuantkitError(f"tensor '{missing[0]}' is missing from the checkpoint at {self.path}")
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._where[name], []).append(name)
        out = {}
        for f, wanted in by_file.items():
            with safe_open(str(f), framework="pt") as handle:
                for name in wanted:
                    out[name] = handle.get_tensor(name).clone()  # own the memory: the mapping closes now
        return out

    def _derive(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Per-expert tensors cut from their layer's fused ones (decoded from MXFP4), each layer's read once."""
        out: dict[str, torch.Tensor] = {}
        for owner in dict.fromkeys(self._derived[n][0] for n in names):
            fused = self._read([f"{owner}.{leaf}" for leaf in self._fused_leaves[owner]])
            fused = {name.rpartition(".")[2]: tensor for name, tensor in fused.items()}
            for name in names:
                layer, expert, leaf, part = self._derived[name]
                if layer == owner:
                    out[name] = expert_part(fused, expert, leaf, part).contiguous()
        return out

    def stored(self, name: str) -> StoredTensor:
        """Where a tensor's bytes are: what the checkpoint writer copies without loading the tensor."""
        if name not in self._stored:
            raise QuantkitError(f"tensor '{name}' is missing from the checkpoint at {self.path}")
        return self._stored[name]

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (1-D) of a 2-D tensor (an embedding) in its stored dtype, read row by row: the rows a set of
        calibration windows uses, without loading a 128k-row table."""
        stored = self.stored(name)
        wanted = ids.tolist()
        bad = [i for i in wanted if not 0 <= i < stored.shape[0]]
        if bad:
            raise QuantkitError(f"token id {bad[0]} is outside '{name}' ({stored.shape[0]} rows) in {self.path}")
        return stored.read_rows(wanted)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from its shard's header (no data is read)."""
        if name in self._derived:
            owner, _, leaf, part = self._derived[name]
            return derived_shape(self._shapes, owner, leaf, part)
        return self.stored(name).shape

    def stored_bytes(self, name: str) -> int:
        """A tensor's size on disk, from its shard's header (a derived tensor: its size in its biases' dtype)."""
        if name in self._derived:
            bias = self.stored(f"{self._derived[name][0]}.gate_up_proj_bias")
            return math.prod(self.shape(name)) * bias.nbytes // max(1, math.prod(bias.shape))
        return self.stored(name).nbytes

    def in_features(self, linears: list[str]) -> dict[str, int]:
        """Each Linear's in-features (``<name>.weight`` is [out, in])."""
        return {name: int(self.shape(f"{name}.weight")[1]) for name in linears}

    def storage_dtype(self) -> torch.dtype:
        """The dtype of the model's float weights (the checkpoint keeps it for unquantized tensors), from the shard
        headers: no tensor is loaded (the first weight may be a 128k-row embedding)."""
        for name, stored in self._stored.items():
            if name.endswith(".weight") and stored.dtype in _FLOAT_DTYPES:
                return _FLOAT_DTYPES[stored.dtype]
        raise QuantkitError(f"no floating-point weight found in {self.path}")

    def fingerprint(self) -> str:
        """Identity of the weights: config.json plus a content hash of every shard (cached per file version)."""
        digest = hashlib.sha256((self.path / "config.json").read_bytes())
        for f in self.files:
            digest.update(shard_digest(f).encode())
        return digest.hexdigest()[:16]


_HASH_CHUNK = 16 << 20
_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _derived_experts(path: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, int, str, str]]:
    """The per-expert tensors a source's fused experts stand for, where its family stores them fused (gpt_oss, float or
    MXFP4: :mod:`quantkit.model.gpt_oss`)."""
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    model_type = config.get("model_type")
    spec = next((a for a in ARCHITECTURES if model_type in a.model_types), None)
    if spec is None or spec.moe is None or spec.moe.fused_layout != INTERLEAVED:
        return {}
    return derived_expert_names(shapes)


def shard_digest(path: Path) -> str:
    """sha256 of a file's contents, computed once per version of the file: cached under the cache directory by
    path, size, modification time and inode, so an edit in place (new mtime) is hashed again."""
    from quantkit.atomic import write_text
    from quantkit.model.cache import cache_dir

    stat = path.stat()
    version = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    cached = cache_dir() / "hashes" / f"{hashlib.sha256(version.encode()).hexdigest()[:32]}.sha256"
    if cached.is_file():
        return cached.read_text().strip()
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    with contextlib.suppress(OSError):  # a read-only cache only costs hashing again next time
        write_text(cached, digest.hexdigest() + "\n")
    return digest.hexdigest()


def head_is_tied(path: Path, head_name: str, weights: SourceWeights) -> bool:
    """The model's head is its embedding: the config ties them, or the files hold no head of its own."""
    from transformers import AutoConfig

    tied = bool(getattr(AutoConfig.from_pretrained(str(path)), "tie_word_embeddings", False))
    return tied or head_name not in weights


def build_skeleton(path: Path) -> nn.Module:
    """The model built from config.json on the meta device: no memory for weights until loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.model.architectures import arch_for_config
    from quantkit.model.moe import unfuse_experts

    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    unfuse_experts(model, arch_for_config(config.to_dict()))  # per-expert linears, named as the files name them
    materialize_meta_buffers(model)  # rotary inv_freq and other non-persistent buffers, on CPU
    return model.eval()


def load_module(
    module: nn.Module,
    prefix: str,
    weights: SourceWeights,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> None:
    """Load ``module``'s parameters and persistent buffers from the shards (float ones cast to ``dtype``) onto
    ``device`` (None: the CPU); each tensor is moved as stored and cast there, one at a time."""
    state = {}
    expected = module.state_dict(keep_vars=True)
    stored_all = weights.get_many([f"{prefix}.{name}" for name in expected])
    for name, tensor in expected.items():
        stored = stored_all.pop(f"{prefix}.{name}").to(device)  # each source tensor freed once converted
        state[name] = stored.to(dtype) if stored.is_floating_point() else stored
        if tuple(stored.shape) != tuple(tensor.shape):
            raise QuantkitError(
                f"{prefix}.{name}: checkpoint shape {tuple(stored.shape)} != model {tuple(tensor.shape)}"
            )
    module.load_state_dict(state, strict=True, assign=True)


def release_module(module: nn.Module) -> None:
    """Free a module's weights by moving them back to the meta device."""
    module.to(device="meta")


def config_json(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())
