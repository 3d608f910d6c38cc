"""A Llama-family decoder layer run stage by stage over all calibration samples (true sequential).

Stages follow ``ArchSpec.sequential_stages``: the inputs of q/k/v, then of o_proj, then of gate/up, then of
down_proj. Each stage's inputs are computed with every earlier stage already quantized, and the expensive
parts are computed once: the attention context (o_proj's input) and the post-attention residual stream are
kept between stages, so attention runs once per block instead of once per stage.

Memory: the block works in place in the input buffer. Once o_proj's stage is done, the input ``h`` is no
longer needed, so the residual stream ``h2`` overwrites it, and the output then overwrites ``h2``; with the
attention context (freed after the gate/up stage), at most two activation buffers exist at once.

With a ``spill`` file (:class:`quantkit.spill.SpillFile`), down_proj's inputs (the widest activations, 4x hidden
size in float32) are written to disk as they are produced, instead of being recomputed by the output pass: the
output then costs one down_proj product per batch instead of the whole MLP (gate/up are two thirds of its work).
The file lives in the page cache, not in the process's resident set, and is overwritten by the next block; the
output is bit-identical either way.

Layer shape assumed (Llama, Mistral, Qwen2, Qwen3):
``h2 = h + attn(norm1(h))``, ``out = h2 + mlp(norm2(h2))``, with ``attn`` ending in o_proj and ``mlp`` in
down_proj.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from quantkit.architectures import ArchSpec
from quantkit.block_io import BlockRunner, get_module, set_module
from quantkit.spill import SpillFile


class StagedBlock:
    def __init__(
        self,
        block: nn.Module,
        arch: ArchSpec,
        runner: BlockRunner,
        hidden: torch.Tensor,
        spill: SpillFile | None = None,
    ) -> None:
        self.block = block
        self.arch = arch
        self.runner = runner
        self.hidden = hidden  # [n, T, H] block input, storage dtype; overwritten by h2, then by the output
        self.norm1 = get_module(block, arch.norms[0])
        self.norm2 = get_module(block, arch.norms[1])
        self.attn = get_module(block, arch.attn_path)
        self.mlp = get_module(block, arch.mlp_path)
        self.o_proj = get_module(block, arch.sequential_stages[1][0])
        self._context: torch.Tensor | None = None  # o_proj inputs
        self._residual: torch.Tensor | None = None  # h2 = h + attn(norm1(h)), in the input's buffer
        self.spill = spill  # where down_proj's inputs go, for the output pass (None: recompute them)
        self._spilled_batches = 0

    def _batches(self) -> Iterator[slice]:
        n, size = self.hidden.shape[0], self.runner.batch_size
        for start in range(0, n, size):
            yield slice(start, min(start + size, n))

    def stage_inputs(self, stage: int) -> Iterator[torch.Tensor]:
        """Float32 inputs [b, T, K] of the linears of ``stage``, mini-batch by mini-batch."""
        producer: Callable[[slice], torch.Tensor] = (
            self._qkv_input,
            self._o_input,
            self._gate_up_input,
            self._down_input,
        )[stage]
        with torch.inference_mode():
            for rows in self._batches():
                yield producer(rows)

    def output(self) -> torch.Tensor:
        """The block output for every sample, with all stages as they are now (storage dtype).

        Written over the residual stream, in the buffer that held the block's input; call it once, last.
        """
        assert self._residual is not None, "run the stages in order before asking for the output"
        out, self._residual = self._residual, None
        if self._spill_complete():
            return self._output_from_spill(out)
        with torch.inference_mode():
            for rows in self._batches():
                h2 = out[rows].float()
                out[rows] = (h2 + self.mlp(self.norm2(h2))).to(out.dtype)
        return out

    def _spill_complete(self) -> bool:
        return self.spill is not None and self._spilled_batches == len(list(self._batches()))

    def _output_from_spill(self, out: torch.Tensor) -> torch.Tensor:
        """``h2 + down_proj(a)`` with the down_proj inputs ``a`` read back from the spill file."""
        assert self.spill is not None
        down = get_module(self.block, self.arch.sequential_stages[3][0])
        self._spilled_batches = 0
        with torch.inference_mode():
            for rows, a in zip(self._batches(), self.spill.read_back(), strict=True):
                out[rows] = (out[rows].float() + down(a)).to(out.dtype)
        return out

    def _qkv_input(self, rows: slice) -> torch.Tensor:
        return self.norm1(self.hidden[rows].float())

    def _o_input(self, rows: slice) -> torch.Tensor:
        if self._context is None:
            n, t, _ = self.hidden.shape
            self._context = torch.empty(n, t, self.o_proj.in_features, dtype=self.hidden.dtype)
        o_path = self.arch.sequential_stages[1][0]
        captured = self._capture_input(o_path, lambda: self._attention(self._qkv_input(rows)))
        self._context[rows] = captured.to(self._context.dtype)
        return captured

    def _gate_up_input(self, rows: slice) -> torch.Tensor:
        assert self._context is not None, "stage 1 must run before stage 2"
        self._residual = self.hidden
        h2 = self.hidden[rows].float() + self.o_proj(self._context[rows].float())
        self._residual[rows] = h2.to(self._residual.dtype)
        if rows.stop == self.hidden.shape[0]:
            self._context = None  # o_proj's inputs are not needed once h2 is complete
        return self.norm2(h2)

    def _down_input(self, rows: slice) -> torch.Tensor:
        assert self._residual is not None, "stage 2 must run before stage 3"
        x = self.norm2(self._residual[rows].float())
        a = self._capture_input(self.arch.sequential_stages[3][0], lambda: self.mlp(x))
        if self.spill is not None:
            if rows.start == 0:
                self.spill.rewind()
                self._spilled_batches = 0
            self.spill.write(a)
            self._spilled_batches += 1
        return a

    def _capture_input(self, path: str, run: Callable[[], object]) -> torch.Tensor:
        """Run ``run()`` with the linear at ``path`` swapped for an :class:`_InputRecorder`; its input.

        The linear's own product is never computed: its output is not needed while its inputs are collected.
        """
        linear = get_module(self.block, path)
        recorder = _InputRecorder()
        set_module(self.block, path, recorder)
        try:
            run()
        finally:
            set_module(self.block, path, linear)
        assert len(recorder.seen) == 1, f"expected one call of {path}, saw {len(recorder.seen)}"
        return recorder.seen[0]

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.runner.position_embeddings
        t = x.shape[1]
        out = self.attn(hidden_states=x, attention_mask=None, position_embeddings=(cos[:, :t], sin[:, :t]))
        return out[0] if isinstance(out, tuple) else out


class _InputRecorder(nn.Module):
    """Stands in for a linear whose output is discarded: records the input and returns it unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x)
        return x
