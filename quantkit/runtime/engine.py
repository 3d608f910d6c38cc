"""The serving engine: requests in, one continuous-batching step at a time, outputs out.

``step()`` is schedule -> run -> postprocess, as in nano-vllm: the scheduler picks the batch; the run drafts tokens
(speculative decoding), runs the model and samples (only sequences whose prefill is complete); the postprocess
appends the tokens (scheduler) and turns them into outputs (:mod:`quantkit.runtime.output_processor`: detokenizing,
stop strings, log-probabilities). Requests that ask for log-probabilities (``SamplingParams.logprobs`` /
``prompt_logprobs``) get them scored from the same forward pass; the others pay nothing for it. A request that could
never run (prompt longer than ``max_model_len``, more KV blocks than the cache holds, invalid sampling parameters,
token ids outside the vocabulary) is refused by ``add_request`` with a ``QuantkitError`` before it touches the
scheduler or the cache; other requests are unaffected.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from pathlib import Path
from typing import Any

import torch

from quantkit.device import resolve_device
from quantkit.errors import QuantkitError
from quantkit.format.files import read_checkpoint_config
from quantkit.model.resolve import resolve_model
from quantkit.runtime.attention_backend import AttentionBackend, select_backend
from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.config import EngineConfig
from quantkit.runtime.model import ModelConfig, load_model, read_generation_eos
from quantkit.runtime.model_runner import ModelRunner, kv_bytes_per_block
from quantkit.runtime.output_processor import OutputProcessor, RequestOutput
from quantkit.runtime.request_checks import check_sampling_ids, prompt_token_ids
from quantkit.runtime.sampler import Sampler
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from quantkit.runtime.sequence import FinishReason, Sequence
from quantkit.runtime.speculative.draft_model import Draft, DraftModel
from quantkit.runtime.speculative.speculator import Speculator
from quantkit.runtime.speculative.stats import SpeculationStats
from quantkit.runtime.state_slots import StateSlotBlockManager
from quantkit.runtime.step_profile import StepProfile
from quantkit.runtime.step_sampling import StepSampler

__all__ = ["Engine", "RequestOutput"]

_log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine:
    def __init__(self, model: str | Path, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise QuantkitError("pass an EngineConfig or keyword options, not both")
        self.config = cfg = config or EngineConfig(**kwargs)
        self.path = resolve_model(model)
        device, dtype = _device_and_dtype(cfg)
        backend = select_backend(cfg.backend, device)
        model_cfg = ModelConfig.from_hf(read_checkpoint_config(self.path))
        if model_cfg.linear_attention is not None and cfg.speculative is not None:
            raise QuantkitError(
                f"speculative decoding is not supported for {model_cfg.model_type}: its linear-attention state cannot "
                "be rolled back past rejected drafts; leave --speculative off"
            )
        self.max_model_len = cfg.resolved_max_model_len(model_cfg.max_position_embeddings)
        # windows are applied per layer (Mistral, Phi-3, Mixtral, Gemma 3); Qwen's opt-in window is not
        if model_cfg.window_unimplemented and self.max_model_len > (model_cfg.sliding_window or 0):
            raise QuantkitError(
                f"the model uses sliding-window attention ({model_cfg.sliding_window} tokens) on the layers from "
                f"max_window_layers on, which the runtime does not implement; set max_model_len <= "
                f"{model_cfg.sliding_window}"
            )
        self.model = load_model(
            self.path,
            dtype=dtype,
            device=device,
            use_kernels=backend.name == "triton" and device.type == "cuda",
            max_positions=self.max_model_len,
        )
        num_blocks = cfg.num_blocks(kv_bytes_per_block(self.model, cfg.block_size, dtype, cfg.kv_cache_dtype))
        if model_cfg.linear_attention is None:
            self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
            self.runner = ModelRunner(self.model, backend, num_blocks, cfg.block_size, dtype, cfg.kv_cache_dtype)
        else:  # a hybrid (Qwen3.5): a state slot per running sequence, no prefix caching (StateSlotBlockManager)
            slots = StateSlotBlockManager(num_blocks, cfg.block_size, cfg.max_num_seqs)
            self.block_manager = slots
            self.runner = ModelRunner(
                self.model, backend, num_blocks, cfg.block_size, dtype, cfg.kv_cache_dtype, slots.slot, cfg.max_num_seqs
            )
        assert cfg.max_num_batched_tokens is not None  # EngineConfig resolves it
        sched_cfg = SchedulerConfig(
            cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len, cfg.enable_chunked_prefill
        )
        self.scheduler = Scheduler(sched_cfg, self.block_manager, read_generation_eos(self.path))
        self.sampler = Sampler(torch.Generator(device).manual_seed(cfg.seed))
        self.tokenizer = _try_tokenizer(self.path)
        self.device = device
        self.speculator = self._speculator(cfg, backend, num_blocks, dtype, device)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self.step_sampler = StepSampler(self.sampler, self.output_processor, self.scheduler, self.speculator)
        self.profile = StepProfile()
        self._ids = itertools.count()
        self._idle_steps = 0
        self.num_preemptions = 0  # sequences sent back to waiting so far (metrics)
        self.num_failed_requests = 0  # requests finished with an error by a step (metrics)
        self.num_failed_steps = 0  # steps in which every request failed
        self.consecutive_failed_steps = 0  # reset by a step in which some request succeeded (health)

    def _speculator(
        self, cfg: EngineConfig, backend: AttentionBackend, num_blocks: int, dtype: torch.dtype, device: torch.device
    ) -> Speculator | None:
        if cfg.speculative is None:
            return None
        draft = None
        if cfg.speculative == "draft":
            assert cfg.draft_model is not None  # EngineConfig checks it
            draft = DraftModel(
                cfg.draft_model,
                target_vocab_size=self.model.config.vocab_size,
                target_tokenizer=self.tokenizer,
                max_model_len=self.max_model_len,
                backend=backend,
                num_blocks=num_blocks,
                block_size=cfg.block_size,
                dtype=dtype,
                device=device,
            )
        return Speculator(cfg.num_speculative_tokens, self.max_model_len, draft)

    @property
    def spec_stats(self) -> SpeculationStats:
        """Speculative-decoding counters (all zero with speculation off)."""
        return self.speculator.stats if self.speculator is not None else SpeculationStats()

    @property
    def stream_text(self) -> bool:
        """Decode text every step (streaming); else only at the end or for stop strings."""
        return self.output_processor.stream_text

    @stream_text.setter
    def stream_text(self, value: bool) -> None:
        self.output_processor.stream_text = value

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        tenant: str = "",
        cache_salt: bytes | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ``QuantkitError`` (and queues nothing) for a bad request.

        ``priority``: lower is admitted first among ``tenant``'s waiting requests, ties by arrival; ``tenant``: who
        sent it, the waiting queue is shared fairly between tenants (:mod:`quantkit.runtime.waiting_queue`);
        ``cache_salt``: only requests with the same salt share prefix-cache blocks."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.output_processor:
            raise QuantkitError(f"request id {request_id!r} is already in use")
        params = dataclasses.replace(params) if params is not None else SamplingParams()  # own copy, re-validated
        if params.stop and self.tokenizer is None:
            raise QuantkitError(f"stop strings need a tokenizer and {self.path} has none; use stop_token_ids")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise QuantkitError(f"priority={priority!r} is invalid; use an integer (lower runs first)")
        check_sampling_ids(params, self.model.config.vocab_size)
        seq = Sequence(self.encode(prompt), params, priority=priority, tenant=tenant, cache_salt=cache_salt)
        self.scheduler.add(seq)  # raises for a prompt too long or a request that can never fit
        gen = torch.Generator(self.device).manual_seed(params.seed) if params.seed is not None else None
        self.output_processor.add(request_id, seq, prompt, gen)
        return request_id

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise QuantkitError(f"{self.path} has no tokenizer; pass the prompt as a list of token ids")
            return list(self.tokenizer(prompt).input_ids)
        return prompt_token_ids(prompt, self.model.config.vocab_size)

    def abort(self, request_id: str) -> bool:
        """Cancel a request; False when it is unknown or already finished."""
        seq = self.output_processor.remove(request_id)
        if seq is None:
            return False
        self.scheduler.abort(seq.seq_id)
        self._forget_drafts()
        return True

    def has_unfinished(self) -> bool:
        return not self.scheduler.is_finished()

    # ----------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one batch; returns an output for every request that got a token (or finished) in it.

        A failure fails only the requests it concerns: a request that cannot be sampled fails alone, a batch whose
        forward pass raised fails its own requests; the engine keeps serving (``consecutive_failed_steps`` counts
        steps in which every request failed, for health checks)."""
        with self.profile.stage("schedule"):
            out = self.scheduler.schedule()
        if out.is_empty:
            self._check_progress()
            return []
        self.profile.steps += 1
        self._idle_steps = 0
        self.num_preemptions += len(out.preempted)
        self.output_processor.mark_scheduled(out.seqs)
        try:
            tokens, failed = self._run(out)
        except Exception as exc:
            _log.exception("a batch of %d requests failed; finishing them with an error", len(out.seqs))
            self._count_step(len(out.seqs), len(out.seqs))
            return self._fail(out.seqs, f"{type(exc).__name__}: {exc}")
        self._count_step(len(failed), len(out.seqs))
        outputs = self._fail([out.seqs[i] for i in failed], "; ".join(sorted(set(failed.values())))) if failed else []
        with self.profile.stage("postprocess"):
            return outputs + self._postprocess(out, tokens)

    def _count_step(self, failed: int, total: int) -> None:
        self.num_failed_requests += failed
        if failed == total:
            self.num_failed_steps += 1
            self.consecutive_failed_steps += 1
        else:
            self.consecutive_failed_steps = 0

    def _run(self, out: SchedulerOutput) -> tuple[list[list[int]], dict[int, str]]:
        """Draft (speculative decoding), run the model and sample: the tokens to append to each sequence, and the
        sequences (by index) that could not be sampled, with why."""
        profile = self.profile
        drafts = self._propose(out) if self.speculator is not None and not out.is_prefill else {}
        with profile.stage("prepare"):
            inputs = self.runner.prepare(out)
            scored, owners = self.output_processor.prompt_rows(out) if out.is_prefill else (None, [])
        with profile.stage("forward"):
            if scored is None:
                logits, scores = self.runner.forward(out, inputs), []
            else:
                logits, scores = self.runner.forward_scored(out, inputs, scored)
        self.output_processor.record_prompt_logprobs(owners, scores)
        with profile.stage("sample"):
            return self.step_sampler(out, logits, drafts)

    def _postprocess(self, out: SchedulerOutput, tokens: list[list[int]]) -> list[RequestOutput]:
        sizes = [len(s) - s.num_draft_tokens for s in out.seqs]
        self.scheduler.postprocess(out.seqs, tokens)
        outputs = self.output_processor.process(out.seqs, tokens, sizes)
        if any(o.finished for o in outputs):
            self._forget_drafts()
        return outputs

    def _propose(self, out: SchedulerOutput) -> dict[int, Draft]:
        assert self.speculator is not None
        with self.profile.stage("propose"):
            generators = [self.output_processor.generator(s) for s in out.seqs]
            drafts = self.speculator.propose(out.seqs, generators, self.scheduler.live_seq_ids())
            self.scheduler.add_drafts(out, {seq_id: d.tokens for seq_id, d in drafts.items()})
        return {s.seq_id: drafts[s.seq_id] for s in out.seqs if s.num_draft_tokens}

    def _forget_drafts(self) -> None:
        """The draft state of sequences that finished or were aborted is freed."""
        if self.speculator is not None:
            self.speculator.forget(self.scheduler.live_seq_ids())

    def _check_progress(self) -> None:
        self._idle_steps += 1  # an empty step is normal right after every running sequence was preempted
        if self._idle_steps > 2 and self.has_unfinished():
            raise RuntimeError("the scheduler made no progress for 3 steps with requests waiting (a bug)")

    def _fail(self, seqs: list[Sequence], error: str) -> list[RequestOutput]:
        """Finish ``seqs`` with an error (their blocks freed); ``error`` stays in the outputs and the log (a server
        shows clients a generic message)."""
        _log.error(
            "requests %s failed: %s", ", ".join(self.output_processor.request_id(s) for s in seqs), error
        )  # fmt: skip
        outputs = []
        for seq in seqs:
            if seq.num_draft_tokens:  # unverified drafts are not output
                del seq.token_ids[-seq.num_draft_tokens :]
                seq.num_draft_tokens = 0
            self.scheduler.finish(seq, FinishReason.ERROR)  # frees its blocks and clears the in-flight step
            outputs.append(self.output_processor.fail(seq, error))
        self._forget_drafts()
        return outputs


def _device_and_dtype(cfg: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The device by :func:`quantkit.device.resolve_device` (``auto``: CUDA when available, else CPU); dtype
    ``auto``: bfloat16 on CUDA, float32 on CPU (fp32 matmuls are fastest there)."""
    device = resolve_device(cfg.device)
    dtype = _DTYPES.get(cfg.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return device, dtype


def _try_tokenizer(path: Path) -> Any:
    from quantkit.model.resolve import load_tokenizer

    try:
        return load_tokenizer(path)
    except QuantkitError:
        return None
