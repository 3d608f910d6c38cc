"""Resolve a model argument (local directory, hub id, alias) and load models and tokenizers."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from quantkit.errors import QuantkitError
from quantkit.model.architectures import ArchSpec, arch_for_config, arch_for_model_type
from quantkit.model.gguf_import import ALIASES, ensure_alias, gguf_file_dir

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model(spec: str | Path) -> Path:
    """A local directory holding config.json for ``spec``: an alias, a directory, or a hub id."""
    text = str(spec)
    if text in ALIASES:
        return ensure_alias(text)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise QuantkitError(f"'{path}' has no config.json; pass a Hugging Face model directory")
        return path
    if path.is_file() and path.suffix == ".gguf":  # a GGUF file: its decoded weights, cached by its hash
        return gguf_file_dir(path)
    if path.exists():
        raise QuantkitError(f"'{path}' is a file; pass the model directory that contains config.json")
    if _HUB_ID.match(text):
        return _download(text)
    raise QuantkitError(
        f"model '{text}' not found: pass an existing directory containing config.json, a hub id such as "
        f"org/name, or an alias ({', '.join(sorted(ALIASES))})"
    )


def hub_id_of(spec: str, source: Path) -> str | None:
    """The Hugging Face Hub id of the model ``spec`` names (resolved to the directory ``source``): an alias's
    original, a hub id as given, or the id a directory of the Hub's cache (``models--org--name/snapshots/<rev>``)
    was downloaded from; None for any other local directory, whose origin nothing records."""
    if spec in ALIASES:
        return ALIASES[spec].hub_id or None
    if _HUB_ID.match(spec) and not Path(spec).expanduser().exists():
        return spec
    resolved = Path(source).resolve()
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith("models--"):
        return resolved.parent.parent.name.removeprefix("models--").replace("--", "/", 1)
    return None


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(
            repo_id,
            # README.md: the model card, whose license a quantized checkpoint's card carries
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*", "README.md"],
        )
    except Exception as exc:  # offline, unknown repo, gated repo: all reported the same way
        raise QuantkitError(
            f"could not fetch '{repo_id}' from the Hugging Face Hub ({type(exc).__name__}: {exc}); "
            "without network access, download the model elsewhere and pass its local directory instead"
        ) from exc
    return Path(local)


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def arch_for_dir(path: Path) -> ArchSpec:
    """The architecture of the model at ``path``, expanded for its config (an MoE family's experts)."""
    raw = read_config(path)
    spec = arch_for_model_type(str(raw.get("model_type", "<missing model_type>")))
    if spec.moe is None:
        return spec
    from transformers import AutoConfig

    # config.json may leave out what equals the config class's default (the number of experts among them)
    return arch_for_config(AutoConfig.from_pretrained(str(path)).to_dict())


def is_quantized_dir(path: Path) -> bool:
    quant = read_config(path).get("quantization_config") or {}
    return quant.get("quant_method") == "compressed-tensors"


def load_model(
    spec: str | Path, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> PreTrainedModel:
    """Load a causal LM (float or quantkit/compressed-tensors checkpoint) for evaluation, in eval mode, read on the
    CPU and moved to ``device`` (None: kept on the CPU)."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dtype = dtype or torch.float32
    path = resolve_model(spec)
    from quantkit.model.moe import unfuse_experts

    arch = arch_for_dir(path)  # fail early, with the list of supported architectures
    if is_quantized_dir(path):
        from quantkit.format.loader import load_quantized_model

        # dequantize once, not per forward; experts as per-expert linears, as the checkpoint stores them
        model = load_quantized_model(path, dtype=dtype, cache_weight=True, prepare=lambda m: unfuse_experts(m, arch))
    else:
        model = _load_float(path, dtype)
        unfuse_experts(model, arch)  # the same modules as a quantized checkpoint's, so both compute alike
    return model.to(device).eval() if device is not None else model.eval()


def _load_float(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """transformers' model of a float checkpoint; the hub's gpt-oss (MXFP4 experts) dequantized, as transformers does
    it (exact values, in bf16) and cast to ``dtype`` with the rest, so that its experts can be unfused."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from quantkit.model.gpt_oss import is_mxfp4

    if not is_mxfp4(read_config(path)):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    config = Mxfp4Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=config).to(dtype)


def load_tokenizer(spec: str | Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    path = resolve_model(spec)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise QuantkitError(f"could not load a tokenizer from '{path}': {exc}") from exc


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Stable identity of a tokenizer's vocabulary, to refuse calibration data made with another one."""
    import hashlib

    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()
    return digest[:16]
