"""Driving a decoder explicitly, block by block: embed the inputs, then run one decoder layer at a time.

No exception stops a forward pass: the pipeline calls the embedding, the rotary module and each decoder layer
itself. Hidden states between blocks are kept in ``storage_dtype`` and each block computes in float32 on
mini-batches, so memory holds one block's weights and two activation buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.model.architectures import ArchSpec
from quantkit.model.precision import forward_precision

BlockForward = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (block, hidden [B,T,H]) -> [B,T,H]


def get_module(root: nn.Module, path: str) -> nn.Module:
    module = root
    for part in path.split("."):
        module = getattr(module, part)
    return module


def set_module(root: nn.Module, path: str, value: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(get_module(root, parent) if parent else root, name, value)


@dataclass(slots=True)
class BlockRunner:
    """Runs decoder layers on hidden states of a fixed sequence length, in float32 mini-batches.

    Each layer gets the attention inputs the model's own forward gives it: the rotary table of its layer type
    (Gemma 3's sliding layers use a local base) and, for a sliding-window layer whose window is shorter than the
    windows, a banded causal mask (without one, attention is plain causal)."""

    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    batch_size: int = 8
    by_layer_type: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    attn_path: str = "self_attn"
    causal_mask: bool = False  # pass a causal mask to every layer (ArchSpec.explicit_causal_mask: gpt_oss)
    mixer_paths: tuple[str, ...] = ()  # a hybrid model's token mixers (ArchSpec.mixers): each layer holds one of them
    # the products of the staged passes and of :meth:`run` (quantkit.model.precision); tuning's stay float32
    compute_dtype: torch.dtype = torch.float32

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        arch: ArchSpec,
        seq_len: int,
        batch_size: int = 8,
        device: torch.device | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ) -> BlockRunner:
        """The rotary tables computed where the model's rotary module lives, kept on ``device`` (None: there)."""
        rotary = get_module(model, arch.rotary_path)
        where = next(rotary.buffers(), torch.empty(0)).device
        probe = torch.zeros(1, seq_len, 1, dtype=torch.float32, device=where)
        positions = torch.arange(seq_len, device=where).unsqueeze(0)

        def table(*layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
            cos, sin = rotary(probe, positions, *layer_type)
            return cos.float().to(device), sin.float().to(device)

        layer_types = tuple(getattr(rotary, "layer_types", None) or ())  # one table per type (Gemma 3)
        by_type = {name: table(name) for name in layer_types}
        default = by_type[layer_types[0]] if layer_types else table()
        mixers = tuple(mixer.attn_path for mixer in arch.mixers)
        return cls(default, batch_size, by_type, arch.attn_path, arch.explicit_causal_mask, mixers, compute_dtype)

    def precision(self) -> AbstractContextManager[object]:
        """The context the staged passes compute their products in (:mod:`quantkit.model.precision`)."""
        return forward_precision(self.compute_dtype, self.position_embeddings[0].device)

    def attention_inputs(self, block: nn.Module, seq_len: int) -> dict[str, object]:
        """``position_embeddings`` and ``attention_mask`` for ``block``'s attention on windows of ``seq_len``."""
        path = next((p for p in self.mixer_paths if hasattr(block, p)), self.attn_path)
        attention = get_module(block, path)
        cos, sin = self.by_layer_type.get(getattr(attention, "layer_type", None) or "", self.position_embeddings)
        window = getattr(attention, "sliding_window", None)
        mask = None if not window or window >= seq_len else _banded_causal_mask(seq_len, int(window), cos.device)
        if mask is None and self.causal_mask:
            mask = _banded_causal_mask(seq_len, seq_len, cos.device)
        return {"attention_mask": mask, "position_embeddings": (cos[:, :seq_len], sin[:, :seq_len])}

    def _call_kwargs(self, block: nn.Module, seq_len: int, for_autograd: bool = False) -> dict[str, object]:
        inputs = self.attention_inputs(block, seq_len)
        cos, sin = inputs["position_embeddings"]  # type: ignore[misc]
        if for_autograd and cos.is_inference():  # made under inference_mode: backward could not save them
            inputs["position_embeddings"] = (cos.clone(), sin.clone())
        return {**inputs, "use_cache": False}

    def __call__(self, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """One block on a [B, T, H] batch, computed in float32 (causal attention, no cache)."""
        out = block(hidden.float(), **self._call_kwargs(block, hidden.shape[1]))
        return out[0] if isinstance(out, tuple) else out

    def functional(self, block: nn.Module, params: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """Like :meth:`__call__`, with ``params`` (by parameter name relative to the block, e.g.
        ``"mlp.up_proj.weight"``) standing in for the block's own tensors during the call
        (:func:`torch.func.functional_call`; tensors not named keep the block's), so gradients reach them."""
        kwargs = self._call_kwargs(block, hidden.shape[1], for_autograd=True)
        out = torch.func.functional_call(block, params, (hidden.float(),), kwargs)
        return out[0] if isinstance(out, tuple) else out

    def run(self, block: nn.Module, hidden: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The block over all samples, mini-batch by mini-batch; output in ``out_dtype`` (default: input's)."""
        out = torch.empty(hidden.shape, dtype=out_dtype or hidden.dtype, device=hidden.device)
        with torch.inference_mode(), self.precision():
            for start in range(0, hidden.shape[0], self.batch_size):
                stop = start + self.batch_size
                out[start:stop] = self(block, hidden[start:stop]).to(out.dtype)
        return out


def _banded_causal_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Additive [1, 1, T, T] mask: query i sees keys i - window < j <= i (transformers' sliding-window rule)."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    allowed = (j <= i) & (i - j < window)
    mask = torch.zeros(seq_len, seq_len, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]


def embed(model: nn.Module, arch: ArchSpec, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The first block's input: the token embeddings of ``input_ids`` [B, T], stored as ``dtype``."""
    with torch.inference_mode():
        return get_module(model, arch.embed_path)(input_ids).to(dtype)
