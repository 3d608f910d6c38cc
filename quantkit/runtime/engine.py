"""The serving engine: requests in, one continuous-batching step at a time, outputs out.

``step()`` is: schedule -> run the model -> sample (only sequences whose prefill is complete) -> postprocess ->
detokenize and apply stop strings (:mod:`quantkit.runtime.detokenizer`). Requests that ask for log-probabilities
(``SamplingParams.logprobs`` / ``prompt_logprobs``, :mod:`quantkit.runtime.logprobs`) get them scored from the same
forward pass; the others pay nothing for it. A request that could never run (prompt
longer than ``max_model_len``, more KV blocks than the cache holds, invalid sampling parameters, token ids outside
the vocabulary) is refused by ``add_request`` with a ``QuantkitError`` before it touches the scheduler or the
cache; other requests are unaffected.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.device import resolve_device
from quantkit.errors import QuantkitError
from quantkit.format.files import read_checkpoint_config
from quantkit.memory import keep_freed_memory_for_reuse
from quantkit.model.resolve import resolve_model
from quantkit.runtime.attention_backend import select_backend
from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.config import EngineConfig
from quantkit.runtime.detokenizer import Detokenizer
from quantkit.runtime.logprobs import TokenLogprob, token_logprobs
from quantkit.runtime.model import ModelConfig, load_model, read_generation_eos
from quantkit.runtime.model_runner import ModelRunner, ScoredRows, kv_bytes_per_block
from quantkit.runtime.sampler import Sampler
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from quantkit.runtime.sequence import FinishReason, Sequence
from quantkit.runtime.speculative.draft_model import Draft, DraftModel
from quantkit.runtime.speculative.speculator import Speculator
from quantkit.runtime.speculative.stats import SpeculationStats
from quantkit.runtime.step_profile import StepProfile

_log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step (``finished`` once it is done); ``token_ids`` are the completion's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None  # why the request failed or was refused (finish_reason ERROR)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0  # time.perf_counter() stamps
    first_token_time: float | None = None
    finish_time: float | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing scores it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    logprobs: list[TokenLogprob] | None = None  # with SamplingParams.logprobs: one per completion token


@dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    seq: Sequence
    prompt: str | None
    generator: torch.Generator | None  # per-request seed; kept across preemption
    arrival_time: float
    detokenizer: Detokenizer | None  # None: the model has no tokenizer (no text)
    first_token_time: float | None = None
    text: str = ""
    finish_time: float | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled by prefill steps, in prompt order
    logprobs: list[TokenLogprob] | None = None  # appended as tokens are sampled (trimmed to the completion on output)


class Engine:
    def __init__(self, model: str | Path, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise QuantkitError("pass an EngineConfig or keyword options, not both")
        self.config = cfg = config or EngineConfig(**kwargs)
        self.path = resolve_model(model)
        keep_freed_memory_for_reuse()  # the decode loop reuses the same temporaries (quantkit/memory.py)
        device, dtype = _device_and_dtype(cfg)
        backend = select_backend(cfg.backend, device)
        model_cfg = ModelConfig.from_hf(read_checkpoint_config(self.path))
        self.max_model_len = cfg.resolved_max_model_len(model_cfg.max_position_embeddings)
        if model_cfg.sliding_window is not None and self.max_model_len > model_cfg.sliding_window:
            raise QuantkitError(
                f"the model uses sliding-window attention ({model_cfg.sliding_window} tokens), which the runtime "
                f"does not implement; set max_model_len <= {model_cfg.sliding_window}"
            )
        self.model = load_model(
            self.path,
            dtype=dtype,
            device=device,
            use_kernels=backend.name == "triton" and device.type == "cuda",
            max_positions=self.max_model_len,
        )
        num_blocks = cfg.num_blocks(kv_bytes_per_block(self.model, cfg.block_size, dtype, cfg.kv_cache_dtype))
        self.runner = ModelRunner(self.model, backend, num_blocks, cfg.block_size, dtype, cfg.kv_cache_dtype)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        sched_cfg = SchedulerConfig(
            cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len, cfg.enable_chunked_prefill
        )
        self.scheduler = Scheduler(sched_cfg, self.block_manager, read_generation_eos(self.path))
        self.sampler = Sampler(torch.Generator(device).manual_seed(cfg.seed))
        self.tokenizer = _try_tokenizer(self.path)
        self.device = device
        self.speculator = self._speculator(cfg, backend, num_blocks, dtype, device)
        self.profile = StepProfile()
        self._requests: dict[int, _Request] = {}  # by seq_id
        self._by_id: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._idle_steps = 0
        self.num_preemptions = 0  # sequences sent back to waiting so far (metrics)
        self.stream_text = False  # decode text every step (streaming); else only at the end or for stop strings

    def _speculator(
        self, cfg: EngineConfig, backend: Any, num_blocks: int, dtype: torch.dtype, device: torch.device
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

    # ----------------------------------------------------------------- requests
    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; returns its id. Raises ``QuantkitError`` (and queues nothing) for a bad request."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._by_id:
            raise QuantkitError(f"request id {request_id!r} is already in use")
        params = dataclasses.replace(params) if params is not None else SamplingParams()  # own copy, re-validated
        if params.stop and self.tokenizer is None:
            raise QuantkitError(f"stop strings need a tokenizer and {self.path} has none; use stop_token_ids")
        seq = Sequence(self.encode(prompt), params)
        self.scheduler.add(seq)  # raises for a prompt too long or a request that can never fit
        gen = torch.Generator(self.device).manual_seed(params.seed) if params.seed is not None else None
        text_prompt = prompt if isinstance(prompt, str) else None
        detok = Detokenizer(self.tokenizer, params.stop) if self.tokenizer is not None else None
        req = _Request(request_id, seq, text_prompt, gen, time.perf_counter(), detok)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        if params.logprobs is not None:
            req.logprobs = []
        self._requests[seq.seq_id] = self._by_id[request_id] = req
        return request_id

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise QuantkitError(f"{self.path} has no tokenizer; pass the prompt as a list of token ids")
            return list(self.tokenizer(prompt).input_ids)
        vocab = self.model.config.vocab_size
        try:  # any integer-like ids (numpy, 0-d tensors); bools and floats are refused
            ids = [operator.index(t) for t in prompt if not isinstance(t, bool)]
            if len(ids) != len(prompt):
                raise TypeError
        except TypeError:
            raise QuantkitError("a prompt must be a string or a list of integer token ids") from None
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise QuantkitError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def abort(self, request_id: str) -> bool:
        """Cancel a request; False when it is unknown or already finished."""
        req = self._by_id.pop(request_id, None)
        if req is None:
            return False
        self._requests.pop(req.seq.seq_id, None)
        self.scheduler.abort(req.seq.seq_id)
        if self.speculator is not None:
            self.speculator.forget(self.scheduler.live_seq_ids())
        return True

    def has_unfinished(self) -> bool:
        return not self.scheduler.is_finished()

    # ----------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one batch; returns an output for every request that got a token (or finished) in it."""
        profile = self.profile
        with profile.stage("schedule"):
            out = self.scheduler.schedule()
        if out.is_empty:
            self._check_progress()
            return []
        profile.steps += 1
        self._idle_steps = 0
        self.num_preemptions += len(out.preempted)
        try:
            drafts = self._propose(out) if self.speculator is not None and not out.is_prefill else {}
            with profile.stage("prepare"):
                inputs = self.runner.prepare(out)
                scored, owners = self._prompt_rows(out) if out.is_prefill else (None, [])
            with profile.stage("forward"):
                if scored is None:
                    logits, scores = self.runner.forward(out, inputs), []
                else:
                    logits, scores = self.runner.forward_scored(out, inputs, scored)
            for req, score in zip(owners, scores, strict=True):
                req.prompt_logprobs.append(score)  # type: ignore[union-attr]
            with profile.stage("sample"):
                tokens = self._sample(out, logits, drafts)
        except Exception as exc:  # a failed batch fails its own requests, not the engine
            return self._fail(out.seqs, exc)
        with profile.stage("postprocess"):
            sizes = [len(s) - s.num_draft_tokens for s in out.seqs]
            self.scheduler.postprocess(out.seqs, tokens)
            outputs = self._outputs(out.seqs, tokens, sizes)
            if self.speculator is not None and any(o.finished for o in outputs):
                self.speculator.forget(self.scheduler.live_seq_ids())
            return outputs

    def _propose(self, out: SchedulerOutput) -> dict[int, Draft]:
        assert self.speculator is not None
        with self.profile.stage("propose"):
            generators = [self._requests[s.seq_id].generator for s in out.seqs]
            drafts = self.speculator.propose(out.seqs, generators, self.scheduler.live_seq_ids())
            self.scheduler.add_drafts(out, {seq_id: d.tokens for seq_id, d in drafts.items()})
        return {s.seq_id: drafts[s.seq_id] for s in out.seqs if s.num_draft_tokens}

    def _prompt_rows(self, out: SchedulerOutput) -> tuple[ScoredRows | None, list[_Request]]:
        """The rows of a prefill step that score prompt tokens not scored yet (position ``p`` scores token ``p + 1``),
        and the request each belongs to; (None, []) when no request in the step scores its prompt."""
        rows: list[int] = []
        targets: list[int] = []
        ks: list[int] = []
        owners: list[_Request] = []
        offset = 0
        for seq, n in zip(out.seqs, out.num_tokens, strict=True):
            req = self._requests[seq.seq_id]
            k = seq.sampling_params.prompt_logprobs
            if req.prompt_logprobs is not None and k is not None:
                start = seq.num_computed_tokens
                # scored already: tokens [0, len); a re-prefill after preemption scores nothing again
                first, end = max(start, len(req.prompt_logprobs) - 1), min(start + n, seq.num_prompt_tokens - 1)
                rows += range(offset + first - start, offset + end - start)
                targets += seq.token_ids[first + 1 : end + 1]
                ks += [k] * max(0, end - first)
                owners += [req] * max(0, end - first)
            offset += n
        return (ScoredRows(rows, targets, ks), owners) if rows else (None, [])

    def _check_progress(self) -> None:
        self._idle_steps += 1  # an empty step is normal right after every running sequence was preempted
        if self._idle_steps > 2 and self.has_unfinished():
            raise RuntimeError("the scheduler made no progress for 3 steps with requests waiting (a bug)")

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor, drafts: dict[int, Draft]) -> list[list[int]]:
        """Tokens to append per sequence: one sampled token; the verified drafts and one token after a
        speculative pass; none for a partial prefill chunk (which must not draw from a generator)."""
        seqs, tokens = out.seqs, [[] for _ in out.seqs]
        first = list(itertools.accumulate([0, *out.num_tokens]))  # logits row of each sequence's first token
        last_row = [first[i + 1] - 1 for i in range(len(seqs))] if not out.is_prefill else list(range(len(seqs)))
        done = [s.num_computed_tokens + n == len(s) for s, n in zip(seqs, out.num_tokens, strict=True)]
        # a prefill-only request (max_tokens 0) samples nothing
        plain = [
            i for i, s in enumerate(seqs) if done[i] and s.seq_id not in drafts and s.sampling_params.max_tokens > 0
        ]
        if plain:
            rows = [last_row[i] for i in plain]
            sub = logits if len(rows) == logits.shape[0] else logits[rows]
            gens = [self._requests[seqs[i].seq_id].generator for i in plain]
            sampled = self.sampler(sub, [seqs[i].sampling_params for i in plain], gens)
            for i, t in zip(plain, sampled, strict=True):
                tokens[i] = [t]
            scored = [j for j, i in enumerate(plain) if seqs[i].sampling_params.logprobs is not None]
            if scored:
                self._score(sub[scored], [seqs[plain[j]] for j in scored], [sampled[j] for j in scored])
        assert self.speculator is not None or not drafts
        for i, seq in enumerate(seqs):
            if seq.seq_id in drafts:
                generator = self.sampler.generator_for(self._requests[seq.seq_id].generator)
                rows = logits[first[i] : first[i + 1]]
                tokens[i] = self.speculator.verify(seq, drafts[seq.seq_id], rows, generator)  # type: ignore[union-attr]
                if seq.sampling_params.logprobs is not None:  # row j scored the j-th token appended
                    self._score(rows[: len(tokens[i])], [seq] * len(tokens[i]), tokens[i])
        return tokens

    def _score(self, logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> None:
        """Record the log-probability of each sampled token (row ``r`` of ``logits`` scored ``tokens[r]``)."""
        ks = [s.sampling_params.logprobs or 0 for s in seqs]
        for seq, score in zip(seqs, token_logprobs(logits, tokens, ks), strict=True):
            self._requests[seq.seq_id].logprobs.append(score)  # type: ignore[union-attr]

    def _fail(self, seqs: list[Sequence], exc: Exception) -> list[RequestOutput]:
        _log.exception("a batch of %d requests failed; finishing them with an error", len(seqs))
        outputs = []
        for seq in seqs:
            if seq.num_draft_tokens:  # unverified drafts are not output
                del seq.token_ids[-seq.num_draft_tokens :]
                seq.num_draft_tokens = 0
            self.scheduler.finish(seq, FinishReason.ERROR)  # frees its blocks and clears the in-flight step
            req = self._requests.pop(seq.seq_id)
            del self._by_id[req.request_id]
            req.error, req.finish_time = f"{type(exc).__name__}: {exc}", time.perf_counter()
            outputs.append(self._output(req))
        if self.speculator is not None:
            self.speculator.forget(self.scheduler.live_seq_ids())
        return outputs

    def _outputs(self, seqs: list[Sequence], tokens: list[list[int]], sizes: list[int]) -> list[RequestOutput]:
        """``sizes``: each sequence's token count before this step's tokens were appended."""
        now = time.perf_counter()
        outputs = []
        for seq, new, size in zip(seqs, tokens, sizes, strict=True):
            req = self._requests.get(seq.seq_id)
            if req is None or not (new or seq.is_finished):  # a finished prefill-only request has no new token
                continue
            if req.first_token_time is None and new:
                req.first_token_time = now
            self._detokenize(req, size)
            if seq.is_finished:
                req.finish_time = now
                del self._requests[seq.seq_id]
                del self._by_id[req.request_id]
            outputs.append(self._output(req))
        return outputs

    def _detokenize(self, req: _Request, size_before: int) -> None:
        """Decode the completion; with stop strings, token by token, so several tokens appended in one step
        (accepted drafts) stop exactly where one-token steps would have, and the tokens after are dropped."""
        seq, detok = req.seq, req.detokenizer
        # without stop strings, text is needed only at the end, or every step when streaming
        if detok is None or (not detok.stop and not seq.is_finished and not self.stream_text):
            return
        ends = range(size_before + 1, len(seq) + 1) if detok.stop else [len(seq)]
        for end in ends:
            last = end == len(seq)
            result = detok.update(seq.token_ids[seq.num_prompt_tokens : end], finished=last and seq.is_finished)
            req.text = result.text
            if result.stopped:
                del seq.token_ids[end:]  # tokens after the stop string's end were never to be generated
                if seq.is_finished:
                    seq.finish_reason = FinishReason.STOP
                else:
                    self.scheduler.finish(seq, FinishReason.STOP)
                return

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.completion_token_ids,
            text=req.text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            error=req.error,
            num_cached_tokens=seq.num_cached_tokens,
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time,
            prompt_logprobs=req.prompt_logprobs,
            logprobs=req.logprobs[: seq.num_completion_tokens] if req.logprobs is not None else None,
        )


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
