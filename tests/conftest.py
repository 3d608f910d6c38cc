"""Shared fixtures: a tiny random Llama with a word-level tokenizer (fast), and the real SmolLM2 (e2e)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# Converted models are cached under a directory the tests create, reused across runs.
os.environ.setdefault("QUANTKIT_CACHE", str(REPO / ".cache" / "quantkit"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels run under the CPU interpreter when no GPU is present; the flag must be set before any test
# module imports triton (kernels check it when they are decorated).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

WORDS = [
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "was",
    "her",
    "she",
    "he",
    "it",
    "that",
    "as",
    "for",
    "with",
    "his",
    "had",
    "not",
    "be",
    "on",
    "you",
    "at",
    "by",
    "which",
    "but",
    "have",
    "all",
    "were",
    "so",
    "from",
    "this",
    "very",
    "my",
    "mr",
    "been",
    "they",
    "what",
    "would",
    "no",
    "one",
    "mrs",
    "could",
    "is",
    "when",
    "said",
    "much",
    "an",
    "there",
    "or",
    "more",
    "must",
    "such",
    "elinor",
    "marianne",
    "emma",
    "elizabeth",
    "darcy",
    "anne",
    "wentworth",
]


def build_word_tokenizer(vocab_size: int = 256, add_bos: bool = False):
    """A deterministic word-level tokenizer: specials, common words, then single characters."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    chars = [chr(c) for c in range(33, 127)]
    vocab_list = list(dict.fromkeys(specials + WORDS + chars))[:vocab_size]
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    if add_bos:
        core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )


def save_tiny_model(path: Path, *, add_bos: bool = False, seed: int = 0, **overrides) -> Path:
    from helpers_tiny import tiny_llama

    model = tiny_llama(seed=seed, bos_token_id=1, eos_token_id=2, **overrides)
    model.save_pretrained(path)
    build_word_tokenizer(add_bos=add_bos).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_bos_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_bos") / "model", add_bos=True)


@pytest.fixture(scope="session")
def tiny_calib_file(tiny_model_dir, tmp_path_factory) -> Path:
    """4 x 32 calibration windows of real text for the tiny models (they share one tokenizer)."""
    from quantkit.data.calibration import CalibrationConfig, build_calibration

    text = tmp_path_factory.mktemp("tiny_calib") / "text.txt"
    text.write_text((REPO / "calibration" / "austen_persuasion_eval.txt").read_text()[:20000])
    out = text.with_name("calib.safetensors")
    build_calibration(str(tiny_model_dir), CalibrationConfig(dataset=str(text), num_samples=4, seq_len=32), output=out)
    return out


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real default model, converted once into the test cache. Never skipped: CI must run e2e tests."""
    from quantkit.model.resolve import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture()
def text_corpus(tmp_path) -> Path:
    """A small local text file made of real calibration sentences."""
    import json

    lines = (REPO / "calibration" / "austen_calibration.jsonl").read_text().splitlines()[:6]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(json.loads(line)["text"] for line in lines))
    return path
