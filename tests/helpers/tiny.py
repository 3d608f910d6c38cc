"""Tiny Llama models, a word-level tokenizer and a reference round-to-nearest quantizer for tests (no hub access
needed)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quantkit.format.scheme import QuantizedWeight, QuantScheme
from quantkit.quantization.solvers.grid import quantize_rtn


def tiny_llama_config(**overrides: object) -> LlamaConfig:
    """Hidden 64, 2 layers, 4 heads (2 kv), intermediate 160 (not a multiple of 64), vocab 256."""
    params: dict[str, object] = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 160,
        "vocab_size": 256,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }
    params.update(overrides)
    return LlamaConfig(**params)


def tiny_llama(seed: int = 0, **overrides: object) -> LlamaForCausalLM:
    """A randomly initialised tiny Llama in float32, in eval mode."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).to(torch.float32)
    return model.eval()


def perturb_norms(model: torch.nn.Module, seed: int = 1, spread: float = 0.3) -> None:
    """Set every RMSNorm weight to 1 + spread * N(0, 1), in place: a fresh model's norms are ones, which a rotation
    fold would absorb trivially."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + spread * torch.randn(param.shape, generator=generator))


def rtn_for_tests(
    weight: torch.Tensor,
    scheme: QuantScheme,
    scale_dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> QuantizedWeight:
    """Round-to-nearest test weights; with act-order (no static groups) a random column permutation stands in
    for the Hessian order, so groups are formed in permuted order and g_idx is recorded."""
    w = weight.detach().float()
    if not (scheme.act_order and not scheme.static_groups):
        return quantize_rtn(w, scheme, scale_dtype=scale_dtype)
    k = w.shape[1]
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    permuted = quantize_rtn(w[:, perm], scheme, scale_dtype=scale_dtype)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // scheme.group_len(k)).to(torch.int32)
    qweight = permuted.qweight[:, torch.argsort(perm)]
    return QuantizedWeight(qweight=qweight, scale=permuted.scale, zero=permuted.zero, g_idx=g_idx, scheme=scheme)


def logit_error(model_dir: str | Path, checkpoint: str | Path, calib: str | Path) -> float:
    """Mean squared logit error of a quantized checkpoint against its float model, on a calibration file's windows."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from quantkit.model.resolve import load_model

    ids = load_file(str(calib))["input_ids"].long()
    float_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    quantized = load_model(str(checkpoint), device="cpu")
    with torch.inference_mode():
        expected = float_model(input_ids=ids).logits
        return float((quantized(input_ids=ids).logits.float() - expected).square().mean())


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
    model = tiny_llama(seed=seed, bos_token_id=1, eos_token_id=2, **overrides)
    model.save_pretrained(path)
    build_word_tokenizer(add_bos=add_bos).save_pretrained(path)
    return path


def tiny_calibration(model_dir: Path, folder: Path, num_samples: int, seq_len: int = 32) -> Path:
    """``num_samples`` x ``seq_len`` calibration windows of real text (the first 20,000 characters of held-out
    Persuasion) for a tiny model, written under ``folder``."""
    from helpers.paths import REPO
    from quantkit.data.calibration import CalibrationConfig, build_calibration

    text = folder / "text.txt"
    text.write_text((REPO / "calibration" / "austen_persuasion_eval.txt").read_text()[:20000])
    out = folder / f"calib{num_samples}.safetensors"
    config = CalibrationConfig(dataset=str(text), num_samples=num_samples, seq_len=seq_len)
    build_calibration(str(model_dir), config, output=out)
    return out
