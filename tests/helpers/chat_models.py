"""Tiny chat models for the behaviour checks: the tiny Llama with a chat template, its weights edited so that its
greedy replies are known by construction."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.tiny import save_tiny_model

_TURNS = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} \n{% endfor %}{% if add_generation_prompt %}"
PLAIN_TEMPLATE = _TURNS + "assistant :{% endif %}"
THINK_TEMPLATE = _TURNS + "assistant : <think>{% endif %}"  # opens the reasoning block itself, as DeepSeek-R1's does
EOS, PROBE = 2, 100  # the word tokenizer's </s>, and a character token a repeating model emits

Edit = Callable[[torch.nn.Module], None]


def save_chat_model(path: Path, template: str = PLAIN_TEMPLATE, edit: Edit | None = None) -> Path:
    """The tiny model with a chat template (and room for the shipped prompts: they exceed its 128 positions), its
    weights changed by ``edit``."""
    save_tiny_model(path, max_position_embeddings=1024)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    if edit is not None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            edit(model)
        model.save_pretrained(path)
    return path


def emit_only(token: int) -> Edit:
    """Weights whose greedy choice is ``token`` at every step: the residual's first coordinate is held large and
    positive, the final norm keeps only it, and the head scores only ``token`` from it (quantizing the blocks'
    linears changes none of this)."""

    def edit(model: torch.nn.Module) -> None:
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[token, 0] = 1.0

    return edit


def perturb_head(model: torch.nn.Module) -> None:
    """Noise of unit scale on the head (its weights are about 0.02): greedy choices change."""
    model.lm_head.weight.add_(torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(3)))
