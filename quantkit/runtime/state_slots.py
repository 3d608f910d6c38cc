"""Per-sequence state of hybrid models (Qwen3.5's gated DeltaNet layers), beside the paged KV cache.

A linear-attention layer keeps no per-token cache: each running sequence needs one fixed-size state per such layer
(its conv state and its delta-rule state, :class:`~quantkit.runtime.deltanet.LayerState`), as vLLM's hybrid models
keep one state slot per request next to their KV blocks. The slots are numbered like KV blocks: the block manager
(:class:`StateSlotBlockManager`) hands one out when it allocates a sequence's blocks and takes it back whenever the
blocks are freed (finished, aborted, preempted or yielding for fairness), so the scheduler needs no change; a
preempted sequence is recomputed from position 0, where its layers start from zeros
(:mod:`quantkit.runtime.deltanet`). There are ``max_num_seqs`` slots, the most sequences that run at once, so a
sequence the scheduler admits always finds one.

The tensors themselves (:class:`RecurrentStates`) belong to the model runner, as the KV cache does; the block manager
holds slot numbers only.
"""

from __future__ import annotations

import torch

from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.deltanet import DeltaNetConfig, LayerState
from quantkit.runtime.sequence import Sequence


class RecurrentStates:
    """Every linear-attention layer's states for ``num_slots`` sequences: conv states ``[L, slots, conv_dim, K-1]``
    in the compute dtype (the conv's inputs, as transformers keeps them) and delta-rule states ``[L, slots, Hv, Dk,
    Dv]`` in float32."""

    def __init__(
        self, num_layers: int, num_slots: int, cfg: DeltaNetConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        conv = (num_layers, num_slots, cfg.conv_dim, cfg.conv_kernel - 1)
        self.conv = torch.zeros(conv, dtype=dtype, device=device)
        recurrent = (num_layers, num_slots, cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim)
        self.recurrent = torch.zeros(recurrent, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def layer(self, i: int) -> LayerState:
        return LayerState(self.conv[i], self.recurrent[i])


class StateSlotBlockManager(BlockManager):
    """A :class:`BlockManager` that also gives each allocated sequence a state slot, freed with its blocks.

    Prefix caching is always off: a cached KV block holds the full-attention layers' keys and values only, while the
    linear-attention layers' state after that prefix is in no block, so a prefix hit could not resume them."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        self.num_slots = num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._slots: dict[int, int] = {}  # seq_id -> its slot

    def slot(self, seq: Sequence) -> int:
        """The state slot of an allocated sequence."""
        return self._slots[seq.seq_id]

    def can_allocate(self, seq: Sequence) -> bool:
        return bool(self._free_slots) and super().can_allocate(seq)

    def allocate(self, seq: Sequence) -> None:
        if not self._free_slots:
            raise RuntimeError(f"no free state slot for sequence {seq.seq_id}; check can_allocate first")
        super().allocate(seq)
        self._slots[seq.seq_id] = self._free_slots.pop()

    def deallocate(self, seq: Sequence) -> None:
        super().deallocate(seq)
        slot = self._slots.pop(seq.seq_id, None)  # None: a waiting sequence that never held blocks
        if slot is not None:
            self._free_slots.append(slot)
