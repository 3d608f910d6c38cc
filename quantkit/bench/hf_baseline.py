"""The same requests through Hugging Face ``generate`` in static batches (greedy, the engine's dtype and device):
the baseline of ``quantkit bench --compare-hf``. A batch runs until its longest request is done, so its shorter
requests wait; only the tokens each request asked for (up to and including its EOS) count."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from quantkit.bench.workload import BenchRequest
from quantkit.format.files import read_checkpoint_config
from quantkit.runtime.engine import Engine

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class HFRecord:
    tokens: list[int]
    ttft: float  # seconds from the run's start (every request arrives at t=0) to its first token
    tpot: float | None  # seconds per output token after the first (None: one token)


@dataclass(slots=True)
class HFRun:
    records: list[HFRecord]
    wall: float
    batch_size: int


def useful(tokens: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """The tokens a request asked for: at most max_tokens, up to and including the first EOS."""
    tokens = tokens[:max_tokens]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def load_hf_model(engine: Engine) -> torch.nn.Module:
    """The engine's checkpoint as an HF model (quantized checkpoints through quantkit's loader), on its device."""
    dtype = compute_dtype(engine)
    if "quantization_config" in read_checkpoint_config(engine.path):
        from quantkit.format.loader import load_quantized_model

        model = load_quantized_model(engine.path, dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(engine.path, dtype=dtype)
    return model.to(engine.device).eval()


def compute_dtype(engine: Engine) -> torch.dtype:
    """The engine's compute dtype: ``auto`` is float32 on CPU, bfloat16 on CUDA (as the engine chooses)."""
    return _DTYPES.get(engine.config.dtype) or (torch.bfloat16 if engine.device.type == "cuda" else torch.float32)


def run_hf(model: Any, requests: list[BenchRequest], batch_size: int, eos: set[int], pad: int) -> HFRun:
    """Greedy ``generate`` over batches of ``batch_size`` requests in workload order, prompts left-padded."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())  # once per generation step, after the forward pass
            return scores

    device = next(model.parameters()).device
    records: list[HFRecord] = []
    t0 = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b : b + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in batch], device=device)
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=device)
        clock = StepClock()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(r.max_tokens for r in batch),
                do_sample=False,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([clock]),
            )
        for i, r in enumerate(batch):
            tokens = useful(out[i, width:].tolist(), r.max_tokens, eos)
            first, last = clock.times[0], clock.times[max(len(tokens), 1) - 1]
            tpot = (last - first) / (len(tokens) - 1) if len(tokens) > 1 else None
            records.append(HFRecord(tokens, first - t0, tpot))
    return HFRun(records, time.perf_counter() - t0, batch_size)


def warm_up_hf(model: Any, eos: set[int], pad: int, vocab: int) -> None:
    """Two short requests, so the measured run skips first-call costs."""
    prompts = [BenchRequest([(7 * i + 3) % vocab for i in range(n)], 4, "free") for n in (8, 24)]
    run_hf(model, prompts, 2, eos, pad)
