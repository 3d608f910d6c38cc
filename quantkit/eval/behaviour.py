"""Behaviour beyond perplexity: greedy replies of a model and of its reference to the shipped chat prompts.

Perplexity scores text the model is shown; a quantized model can keep it and still stop ending its replies, fall
into loops, or never close a reasoning tag (a reasoning model that stopped closing ``</think>`` after quantization:
llm-compressor #2680). Per model this measures, over the prompts of ``behaviour_prompts.json`` (passages of the
held-out text; ``python -m tools.build_behaviour_prompts`` rebuilds it):

- end rate: the share of replies that emit a stop token (EOS or the generation config's) within the token limit;
- repetition: per reply, the share of its 4-grams that repeat an earlier 4-gram of the same reply, averaged;
- tag close rate (templates with reasoning tags only): the share of replies that open the tag (or whose prompt
  opens it) and close it; a reply that never opens it counts as not closed, so a model that stops thinking fails
  as one that stops closing does (the open rate, beside it, tells the two apart);

and against the reference, first-32 agreement: per prompt, the share of the first 32 reply positions holding the
same token (the stop counts as a position, so a reply that ends where the other goes on disagrees there). Each
figure has its standard error over prompts, so a difference can be read against the noise.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import QuantkitError
from quantkit.eval.noise import ratio_mean_se
from quantkit.progress import progress_bar

PROMPTS_FILE = Path(__file__).with_name("behaviour_prompts.json")
DEFAULT_BEHAVIOUR_PROMPTS = 32  # every shipped prompt
# Room for the one-sentence and two-sentence replies the prompts ask for, with a margin; a reply still going at the
# limit counts as not ended, so the limit must sit well above what the reference needs (on the default model its
# replies end within it).
DEFAULT_MAX_NEW_TOKENS = 128
AGREEMENT_TOKENS = 32
REPEAT_NGRAM = 4
# Replies per generate call: on a 2-core CPU batched decode is compute-bound long before it is memory-bound, and
# 8 keeps the padding of one batch small (prompts are batched by length).
GENERATION_BATCH = 8
# (opener, closer) pairs of the reasoning formats in use; a template or vocabulary with the opener has them
REASONING_TAGS = (("<think>", "</think>"),)
_ENDED = -1  # stands for "the reply ended here" in agreement, whichever stop token ended it


@dataclass
class BehaviourConfig:
    """How many shipped prompts, and how many new tokens a reply may take; the defaults are the CLI's and recipes'."""

    prompts: int = DEFAULT_BEHAVIOUR_PROMPTS
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    batch_size: int = GENERATION_BATCH
    show_progress: bool = True

    def validate(self) -> None:
        available = len(shipped_prompts())
        if not 1 <= self.prompts <= available:
            raise QuantkitError(f"--behaviour-prompts must be between 1 and {available}, got {self.prompts}")
        if self.max_new_tokens < 1:
            raise QuantkitError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise QuantkitError(f"the generation batch size must be at least 1, got {self.batch_size}")


@dataclass(frozen=True, slots=True)
class Reply:
    tokens: list[int]  # the generated tokens before the stop token
    ended: bool  # a stop token came within the limit
    text: str  # decoded with special tokens kept: a reasoning tag may be one


@dataclass(slots=True)
class ModelBehaviour:
    end_rate: float
    end_rate_se: float
    repetition: float
    repetition_se: float
    mean_reply_tokens: float
    tag_open_rate: float | None = None  # share of replies inside a reasoning block at some point
    tag_close_rate: float | None = None  # share of replies that open the block and close it
    replies: list[str] = field(default_factory=list)


@dataclass(slots=True)
class BehaviourResult:
    prompts: int
    max_new_tokens: int
    reasoning_tags: list[str] | None
    candidate: ModelBehaviour
    reference: ModelBehaviour | None = None
    first32_agreement: float | None = None
    first32_agreement_se: float | None = None
    seconds: float = 0.0

    def difference(self) -> dict[str, float | None]:
        """Candidate minus reference, per figure (None without a reference, or where a figure is absent)."""
        keys = ("end_rate", "repetition", "mean_reply_tokens", "tag_close_rate")
        if self.reference is None:
            return dict.fromkeys(keys)
        return {key: _minus(getattr(self.candidate, key), getattr(self.reference, key)) for key in keys}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"difference": self.difference()}


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def shipped_prompts(count: int | None = None) -> list[str]:
    """The first ``count`` shipped prompts (None: all); the file interleaves the kinds, so any prefix mixes them."""
    prompts = [p["prompt"] for p in json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))["prompts"]]
    return prompts if count is None else prompts[:count]


def check_chat_template(tokenizer: Any, name: str) -> None:
    """Refuse a tokenizer without a chat template before any work: the prompts are chat turns."""
    if not getattr(tokenizer, "chat_template", None):
        raise QuantkitError(
            f"'{name}' has no chat template, which --behaviour needs to ask it the shipped chat prompts; use a "
            "chat/instruct model, or add a chat_template (tokenizer_config.json or chat_template.jinja) to it"
        )


def render_prompts(tokenizer: Any, prompts: list[str], name: str) -> list[str]:
    """Each prompt as one user turn in the tokenizer's chat template, ready for the assistant's reply."""
    check_chat_template(tokenizer, name)
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]


def reasoning_tags(tokenizer: Any) -> tuple[str, str] | None:
    """The reasoning tag pair this tokenizer's template or vocabulary uses, or None."""
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):  # named templates
        template = "\n".join(template.values())
    vocab = tokenizer.get_vocab()
    for opener, closer in REASONING_TAGS:
        if opener in template or (opener in vocab and closer in vocab):
            return opener, closer
    return None


def stop_token_ids(tokenizer: Any, *models: Any) -> list[int]:
    """EOS of the tokenizer and of each model's generation config (an int or a list): every model stops on all."""
    ids: set[int] = set()
    for value in [tokenizer.eos_token_id] + [getattr(m.generation_config, "eos_token_id", None) for m in models]:
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    if not ids:
        raise QuantkitError("the tokenizer and model name no EOS token, so no reply could end; set eos_token")
    return sorted(ids)


def generate_replies(
    model: Any, tokenizer: Any, rendered: list[str], stop_ids: list[int], config: BehaviourConfig, label: str
) -> list[Reply]:
    """Greedy replies to ``rendered`` prompts, ``config.batch_size`` at a time, left-padded (prompts of similar
    length share a batch); in the prompts' order."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    # the template already holds the special tokens it wants (BOS included): add none
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rendered]
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]), i))
    replies: list[Reply | None] = [None] * len(encoded)
    with progress_bar(config.show_progress) as bar, torch.inference_mode():
        task = bar.add_task(f"Replies ({label})", total=len(encoded))
        for start in range(0, len(order), config.batch_size):
            batch = order[start : start + config.batch_size]
            width = max(len(encoded[i]) for i in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, width - len(encoded[i]) :] = torch.tensor(encoded[i])
                mask[row, width - len(encoded[i]) :] = 1
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=False,
                max_new_tokens=config.max_new_tokens,
                eos_token_id=stop_ids,
                pad_token_id=pad,
            )
            for row, i in enumerate(batch):
                replies[i] = _reply(out[row, width:].tolist(), stop_ids, tokenizer)
            bar.advance(task, len(batch))
    return [r for r in replies if r is not None]


def _reply(generated: list[int], stop_ids: list[int], tokenizer: Any) -> Reply:
    stops = set(stop_ids)
    cut = next((i for i, token in enumerate(generated) if token in stops), None)
    tokens = generated if cut is None else generated[:cut]
    return Reply(tokens, cut is not None, tokenizer.decode(tokens, skip_special_tokens=False))


def repetition_share(tokens: list[int], n: int = REPEAT_NGRAM) -> float:
    """The share of the n-grams of ``tokens`` that repeat an earlier n-gram of the same sequence (0 below n)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for gram in grams:
        repeats += gram in seen
        seen.add(gram)
    return repeats / len(grams)


def position_agreement(reference: Reply, candidate: Reply, limit: int = AGREEMENT_TOKENS) -> float:
    """The share of the first ``limit`` positions (of the longer reply, its stop included) with the same token."""
    a = reference.tokens + [_ENDED] * reference.ended
    b = candidate.tokens + [_ENDED] * candidate.ended
    n = min(limit, max(len(a), len(b)))
    if n == 0:
        return 1.0
    return sum(1 for x, y in zip(a[:n], b[:n], strict=False) if x == y) / n


def tag_state(prompt: str, reply: str, tags: tuple[str, str]) -> tuple[bool, bool]:
    """(opened, closed): whether the reply is inside a reasoning block at some point, and whether it closes it.
    A generation prompt may open the block itself (some templates end with the opener)."""
    opener, closer = tags
    if prompt.rfind(opener) > prompt.rfind(closer):
        start = 0
    else:
        found = reply.find(opener)
        if found < 0:
            return False, False
        start = found + len(opener)
    return True, reply.find(closer, start) >= 0


def summarise(replies: list[Reply], rendered: list[str], tags: tuple[str, str] | None) -> ModelBehaviour:
    """One model's figures over its replies, each with its standard error over prompts."""
    ones = [1] * len(replies)
    end_rate, end_se = ratio_mean_se([float(r.ended) for r in replies], ones)
    repetition, repetition_se = ratio_mean_se([repetition_share(r.tokens) for r in replies], ones)
    figures = ModelBehaviour(
        end_rate=end_rate,
        end_rate_se=end_se,
        repetition=repetition,
        repetition_se=repetition_se,
        mean_reply_tokens=sum(len(r.tokens) for r in replies) / len(replies),
        replies=[r.text for r in replies],
    )
    if tags is not None:
        states = [tag_state(prompt, r.text, tags) for prompt, r in zip(rendered, replies, strict=True)]
        figures.tag_open_rate = sum(is_open for is_open, _ in states) / len(states)
        figures.tag_close_rate = sum(is_open and closed for is_open, closed in states) / len(states)
    return figures


def measure_behaviour(
    model: Any,
    tokenizer: Any,
    reference: Any | None = None,
    config: BehaviourConfig | None = None,
    *,
    name: str = "model",
) -> BehaviourResult:
    """Greedy replies of ``model`` (and of ``reference``, the same object allowed) to the shipped prompts, and
    their figures; the reference's replies give the agreement and the differences."""
    config = config or BehaviourConfig()
    config.validate()
    start = time.perf_counter()
    rendered = render_prompts(tokenizer, shipped_prompts(config.prompts), name)
    tags = reasoning_tags(tokenizer)
    stop_ids = stop_token_ids(tokenizer, *(m for m in (model, reference) if m is not None))
    replies = generate_replies(model, tokenizer, rendered, stop_ids, config, "model")
    result = BehaviourResult(
        prompts=len(rendered),
        max_new_tokens=config.max_new_tokens,
        reasoning_tags=list(tags) if tags else None,
        candidate=summarise(replies, rendered, tags),
    )
    if reference is not None:
        # one model as its own reference: the same greedy replies, not generated twice
        ref_replies = (
            replies
            if reference is model
            else generate_replies(reference, tokenizer, rendered, stop_ids, config, "reference")
        )
        result.reference = summarise(ref_replies, rendered, tags)
        agreement = [position_agreement(r, c) for r, c in zip(ref_replies, replies, strict=True)]
        result.first32_agreement, result.first32_agreement_se = ratio_mean_se(agreement, [1] * len(agreement))
    result.seconds = time.perf_counter() - start
    return result
