"""A Llama-family decoder layer run stage by stage over all calibration samples (true sequential).

Stages follow ``ArchSpec.stages``, by name: the inputs of q/k/v (``qkv``), then of o_proj (``o``), then of
gate/up (``gate_up``), then of down_proj (``down``). Each stage's inputs are computed with every earlier stage
already quantized, and the expensive parts are computed once: the attention context (o_proj's input) and the
post-attention residual stream are kept between stages, so attention runs once per block instead of once per
stage.

Memory: the block works in place in the input buffer. Once o_proj's stage is done, the input ``h`` is no
longer needed, so the residual stream ``h2`` overwrites it, and the output then overwrites ``h2``; with the
attention context (freed after the gate/up stage), at most two activation buffers exist at once.

With a ``spill`` file (a :class:`Spill`; the quantizer's is :class:`quantkit.quantization.spill.SpillFile`),
both go to disk instead, each written once and read back once: the attention context, from the o_proj stage to
the gate/up stage (so one activation buffer stays out of memory at the peak), and down_proj's inputs (the widest
activations: the intermediate size, in float32), which the output pass then need not recompute: it costs one
down_proj product per batch instead of the whole MLP (gate/up are two thirds of its work). The file lives in the
page cache, not in the process's resident set, and is overwritten from stage to stage and block to block; the
output is bit-identical either way.

Layer shape assumed (Llama, Mistral, Qwen2, Qwen3, and the mixture-of-experts families):
``h2 = h + attn(norm1(h))``, ``out = h2 + mlp(norm2(h2))``, with ``attn`` ending in o_proj and ``mlp`` in
down_proj, or a sparse MLP whose expert stages :mod:`quantkit.model.staged_moe` feeds.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional

from quantkit.model.architectures import DOWN, GATE_UP, O_PROJ, QKV, ArchSpec, Stage
from quantkit.model.blocks import BlockRunner, get_module, set_module
from quantkit.model.precision import products_autocast
from quantkit.model.staged_moe import ALL, ROUTED, ExpertInputs, expert_stage


class Spill(Protocol):
    """Scratch storage for activations written once and read back once, in order (the quantizer's memory
    strategy decides whether there is one, and where)."""

    def rewind(self) -> None: ...

    def write(self, tensor: torch.Tensor) -> None: ...

    def read_back(self) -> Generator[torch.Tensor]: ...


class StagedBlock:
    def __init__(
        self,
        block: nn.Module,
        arch: ArchSpec,
        runner: BlockRunner,
        hidden: torch.Tensor,
        spill: Spill | None = None,
        moe_calibration: str = ALL,
    ) -> None:
        self.block = block
        self.arch = arch
        self.runner = runner
        self.hidden = hidden  # [n, T, H] block input, storage dtype; overwritten by h2, then by the output
        self.norm1 = get_module(block, arch.norms[0])
        self.norm2 = get_module(block, arch.norms[1])
        self.attn = get_module(block, arch.attn_path)
        self.mlp = get_module(block, arch.mlp_path)
        self.o_proj = get_module(block, arch.stage(O_PROJ).head)
        # Gemma's sandwich norms on the attention's and the MLP's outputs (identity for the other families)
        after_attn, after_mlp = arch.sandwich_norms or (None, None)
        self.attn_out_norm = get_module(block, after_attn) if after_attn else _identity
        self.mlp_out_norm = get_module(block, after_mlp) if after_mlp else _identity
        self._context: torch.Tensor | None = None  # o_proj inputs, when there is no spill file
        self._context_ready = False  # o_proj's stage has run over every batch
        self._context_reader: Generator[torch.Tensor] | None = None  # o_proj inputs read back from the spill file
        self._residual: torch.Tensor | None = None  # h2 = h + attn(norm1(h)), in the input's buffer
        self.spill = spill  # holds the attention context, then down_proj's inputs (None: kept in memory / recomputed)
        self._spilled_batches = 0
        self._gate_up = None if arch.moe else _silu_gate_up(self.mlp, arch)  # None: run the MLP for down's inputs
        self._mlp_scratch: torch.Tensor | None = None  # [2, rows, intermediate]: gate and up products, reused
        self._residual_ready = False  # h2 is complete (the first MLP stage has run over every batch)
        # a sparse MLP: its expert stages' inputs and the routing counts (None for a dense block)
        self.experts = ExpertInputs(self.mlp, moe_calibration) if arch.moe else None
        routed = arch.moe is not None and moe_calibration == ROUTED
        self.stages: tuple[Stage, ...] = arch.routed_stages() if routed else arch.stages
        self.unseen_stages: set[str] = set()  # stages no calibration row reached (their solve is round-to-nearest)

    def batches(self) -> Iterator[slice]:
        n, size = self.hidden.shape[0], self.runner.batch_size
        for start in range(0, n, size):
            yield slice(start, min(start + size, n))

    def stage_inputs(self, stage: str) -> Iterator[torch.Tensor]:
        """Float32 inputs [b, T, K] of the linears of ``stage`` (a stage name), mini-batch by mini-batch.

        A yielded tensor may be overwritten by the next one (down_proj's inputs live in a reused buffer): use it,
        or clone it, before asking for the next.
        """
        producers: dict[str, Callable[[slice], torch.Tensor]] = {
            QKV: self._qkv_input,
            O_PROJ: self._o_input,
            GATE_UP: self._gate_up_input,
            DOWN: self._down_input,
        }
        expert = expert_stage(stage)
        if expert is not None:
            kind, key = expert
            producer = lambda rows: self._expert_input(kind, key, rows)  # noqa: E731
        else:
            producer = producers[stage]
        with torch.inference_mode():
            for rows in self.batches():
                with self.runner.precision():  # not across the yield: autocast is the caller's state too
                    inputs = producer(rows)
                yield inputs.float()  # a bfloat16 product (o_proj's inputs from attention) in float32
        self._mlp_scratch = None

    def residual_in(self, stage: str, rows: slice) -> torch.Tensor | None:
        """The residual stream that ``stage``'s linears add their output to (o_proj: the block input; down_proj:
        h2), for ``rows``, while that stage runs; None for a stage that does not write the residual stream."""
        if stage == O_PROJ:
            return self.hidden[rows]
        if stage == DOWN:
            assert self._residual is not None, "the gate_up stage must run before the down stage"
            return self._residual[rows]
        return None

    def output(self) -> torch.Tensor:
        """The block output for every sample, with all stages as they are now (storage dtype).

        Written over the residual stream, in the buffer that held the block's input; call it once, last.
        """
        assert self._residual is not None, "run the stages in order before asking for the output"
        out, self._residual = self._residual, None
        if self._spill_complete():
            return self._output_from_spill(out)
        with torch.inference_mode(), self.runner.precision():
            for rows in self.batches():
                h2 = out[rows].float()
                mlp = self.mlp(self.norm2(h2))
                mlp = mlp[0] if isinstance(mlp, tuple) else mlp  # gpt_oss's MLP returns (hidden, router scores)
                out[rows] = (h2 + self.mlp_out_norm(mlp)).to(out.dtype)
        return out

    @property
    def output_reads_spill(self) -> bool:
        """Whether :meth:`output` will read down_proj's inputs back from the spill file (all of them are there):
        then no linear of the block but down_proj runs again."""
        return self._spill_complete()

    def _spill_complete(self) -> bool:
        return self.spill is not None and self._spilled_batches == len(list(self.batches()))

    def _output_from_spill(self, out: torch.Tensor) -> torch.Tensor:
        """``h2 + down_proj(a)`` with the down_proj inputs ``a`` read back from the spill file."""
        assert self.spill is not None
        down = get_module(self.block, self.arch.stage(DOWN).head)
        self._spilled_batches = 0
        with torch.inference_mode(), self.runner.precision():
            for rows, a in zip(self.batches(), self.spill.read_back(), strict=True):
                out[rows] = (out[rows].float() + self.mlp_out_norm(down(a))).to(out.dtype)
        return out

    def _qkv_input(self, rows: slice) -> torch.Tensor:
        return self.norm1(self.hidden[rows].float())

    def _o_input(self, rows: slice) -> torch.Tensor:
        o_path = self.arch.stage(O_PROJ).head
        captured = self._capture_input(o_path, lambda: self._attention(self._qkv_input(rows)))
        stored = captured.to(self.hidden.dtype)
        if self.spill is not None:  # kept on disk until the gate/up stage reads it back, batch by batch
            if rows.start == 0:
                self.spill.rewind()
            self.spill.write(stored)
        else:
            if self._context is None:
                n, t, _ = self.hidden.shape
                shape = (n, t, self.o_proj.in_features)
                self._context = torch.empty(shape, dtype=self.hidden.dtype, device=self.hidden.device)
            self._context[rows] = stored
        self._context_ready = rows.stop == self.hidden.shape[0]
        return captured

    def _gate_up_input(self, rows: slice) -> torch.Tensor:
        assert self._context_ready, "the o stage must run before the gate_up stage"
        self._residual = self.hidden
        h2 = self.hidden[rows].float() + self.attn_out_norm(self.o_proj(self._context_batch(rows).float()))
        self._residual[rows] = h2.to(self._residual.dtype)
        x = self.norm2(h2)
        if self.experts is not None:
            self.experts.count(x)  # once per batch: h2 is computed once per block
        if rows.stop == self.hidden.shape[0]:
            self._residual_ready = True
            self._context = None  # o_proj's inputs are not needed once h2 is complete
            self._context_ready = False
            if self._context_reader is not None:
                self._context_reader.close()  # rewinds the spill file for down_proj's inputs
                self._context_reader = None
        return x

    def _expert_input(self, kind: str, key: str, rows: slice) -> torch.Tensor:
        """An expert stage's inputs: from the MLP's input, computing h2 first if no MLP stage has yet."""
        assert self.experts is not None, "expert stages exist only in a mixture-of-experts block"
        if self._residual_ready:
            assert self._residual is not None
            x = self.norm2(self._residual[rows].float())
        else:
            x = self._gate_up_input(rows)
        return self.experts.gate_up(key, x) if kind == GATE_UP else self.experts.down(key, x)

    def _context_batch(self, rows: slice) -> torch.Tensor:
        """o_proj's inputs for ``rows`` (storage dtype), from memory or read back from the spill file."""
        if self._context is not None:
            return self._context[rows]
        assert self.spill is not None
        if rows.start == 0:
            self._context_reader = self.spill.read_back()
        assert self._context_reader is not None
        return next(self._context_reader)

    def _down_input(self, rows: slice) -> torch.Tensor:
        assert self._residual is not None, "the gate_up stage must run before the down stage"
        x = self.norm2(self._residual[rows].float())
        if self._gate_up is not None:
            a = self._gated_activation(x, *self._gate_up)
        else:
            a = self._capture_input(self.arch.stage(DOWN).head, lambda: self.mlp(x))
        if self.spill is not None:
            if rows.start == 0:
                self.spill.rewind()
                self._spilled_batches = 0
            self.spill.write(a)
            self._spilled_batches += 1
        return a

    def _gated_activation(self, x: torch.Tensor, gate: nn.Linear, up: nn.Linear) -> torch.Tensor:
        """``silu(gate(x)) * up(x)``, as the MLP module computes it, into a buffer reused from batch to batch.

        Fresh [rows, intermediate] products for every mini-batch cost page faults and heap fragmentation
        (the largest temporaries of the block); the same two buffers serve every batch instead.
        """
        b, t, k = x.shape
        rows = b * t
        if self._mlp_scratch is None or self._mlp_scratch.shape[1] < rows:
            self._mlp_scratch = torch.empty(2, rows, gate.out_features, device=x.device)
        g, u = self._mlp_scratch[0, :rows], self._mlp_scratch[1, :rows]
        flat = x.reshape(rows, k)
        _linear_into(g, flat, gate)
        functional.silu(g, inplace=True)
        _linear_into(u, flat, up)
        return g.mul_(u).view(b, t, -1)

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
        out = self.attn(hidden_states=x, **self.runner.attention_inputs(self.block, x.shape[1]))
        return out[0] if isinstance(out, tuple) else out


def _silu_gate_up(mlp: nn.Module, arch: ArchSpec) -> tuple[nn.Linear, nn.Linear] | None:
    """The MLP's gate and up linears when it computes ``down(silu(gate(x)) * up(x))`` (Llama, Mistral, Qwen)."""
    linears = arch.stage(GATE_UP).linears
    if len(linears) != 2:  # a fused gate_up_proj (Phi-3): the MLP module computes down's inputs
        return None
    gate_path, up_path = (path.removeprefix(arch.mlp_path + ".") for path in linears)
    gate, up = getattr(mlp, gate_path, None), getattr(mlp, up_path, None)
    act = getattr(mlp, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    if silu and type(gate) is nn.Linear and type(up) is nn.Linear:
        return gate, up
    return None


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _linear_into(out: torch.Tensor, x: torch.Tensor, linear: nn.Linear) -> None:
    """``out = linear(x)`` for 2-D ``x``, written into ``out`` (the same product ``nn.Linear`` computes; under
    a lower-precision autocast, that precision's product: an ``out=`` product would not be autocast)."""
    if products_autocast(x.device):
        out.copy_(linear(x))
    elif linear.bias is None:
        torch.mm(x, linear.weight.T, out=out)
    else:
        torch.addmm(linear.bias, x, linear.weight.T, out=out)


class _InputRecorder(nn.Module):
    """Stands in for a linear whose output is discarded: records the input and returns it unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x)
        return x
