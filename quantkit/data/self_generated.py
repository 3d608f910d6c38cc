"""Calibration windows the model writes itself: data-free calibration for a job that has no text at hand (or must
not read any). Each window starts after the end-of-document token, as a new document does in the joined calibration
stream, and is sampled token by token from the model's own distribution (temperature 1, nucleus 0.95), so its
activations are the model's typical ones without any dataset. Seeded: the same seed gives the same windows."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quantkit.errors import QuantkitError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SELF_GENERATED = "self"  # the --dataset value that asks for these windows
TOP_P = 0.95  # drops the long tail of unlikely tokens that would make the text degenerate
GENERATION_BATCH = 16  # windows sampled together


def generate_windows(
    model: str | Path, tokenizer: PreTrainedTokenizerBase, num_samples: int, length: int, seed: int
) -> list[list[int]]:
    """``num_samples`` windows of ``length`` tokens sampled from ``model``."""
    from quantkit.model.resolve import load_model

    start = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
    if start is None:
        raise QuantkitError(
            f"--dataset {SELF_GENERATED}: the tokenizer of {model} has no end-of-document or BOS token to start "
            "generating from; give a --dataset text instead"
        )
    lm = load_model(model)
    torch.manual_seed(seed)
    windows: list[list[int]] = []
    with torch.inference_mode():
        while len(windows) < num_samples:
            batch = min(GENERATION_BATCH, num_samples - len(windows))
            prompt = torch.full((batch, 1), start, dtype=torch.long)
            out = lm.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                temperature=1.0,
                top_p=TOP_P,
                top_k=0,
                min_new_tokens=length,
                max_new_tokens=length,
                pad_token_id=start,
            )
            windows += out[:, 1:].tolist()
    return windows
