"""Offline batch generation: ``LLM(model).generate(prompts, sampling)``, on top of :class:`Engine`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.runtime.engine import Engine, RequestOutput
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.sequence import FinishReason


class LLM:
    """``model``: a quantized checkpoint, a Hugging Face model directory, an alias or a hub id.

    ``engine_kwargs`` are :class:`~quantkit.runtime.config.EngineConfig` fields (max_num_seqs, backend, ...).

    The process-wide allocator policy stays the caller's: ``quantkit serve``, ``bench`` and ``smoke`` keep freed
    memory for reuse (faster decode steps); a script that mostly generates may call
    :func:`quantkit.memory.keep_freed_memory_for_reuse` itself, one that also quantizes should not.
    """

    def __init__(self, model: str | Path, **engine_kwargs: Any) -> None:
        self.engine = Engine(model, **engine_kwargs)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order.

        A prompt the engine refuses (too long, can never fit the KV cache, invalid sampling parameters) gets an
        output with ``finish_reason`` ERROR and the reason in ``error``; the other prompts still run.
        """
        from quantkit.progress import progress_bar

        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling or SamplingParams()] * len(prompts)
        else:
            params = list(sampling)
            if len(params) != len(prompts):
                raise QuantkitError(f"{len(prompts)} prompts but {len(params)} sampling parameters")
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        engine = self.engine
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            try:
                order.append(engine.add_request(prompt if isinstance(prompt, str) else list(prompt), p))
            except QuantkitError as exc:
                key = f"error-{i}"
                order.append(key)
                results[key] = _error_output(key, prompt, exc)
        with progress_bar(use_tqdm) as bar:
            task = bar.add_task("generate", total=len(order))
            bar.advance(task, len(results))
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.advance(task)
        return [results[key] for key in order]


def _error_output(key: str, prompt: Any, exc: Exception) -> RequestOutput:
    text_prompt = prompt if isinstance(prompt, str) else None
    ids = [] if isinstance(prompt, str) else list(prompt)
    return RequestOutput(key, text_prompt, ids, [], "", True, FinishReason.ERROR, error=str(exc))
