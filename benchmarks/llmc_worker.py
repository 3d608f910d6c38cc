"""llm-compressor side of benchmarks/bench_llmcompressor.py: one `oneshot` run on quantkit's calibration windows.

Runs in llm-compressor's own virtual environment (its pins conflict with quantkit's), so it imports nothing from
quantkit: the calibration file is read with safetensors directly (tensor ``input_ids``, int32 [windows, seq_len],
metadata ``format = quantkit-calibration/1``).

    /work/tmp/llmc-venv/bin/python -m benchmarks.llmc_worker --model DIR --calib calib.safetensors \\
        --method gptq --output OUT --info OUT.json

The token ids go to ``oneshot`` as a pre-tokenized ``datasets.Dataset`` (``input_ids`` and an all-ones
``attention_mask``), which llm-compressor uses as given (no tokenizer, no chat template, no concatenation);
``num_calibration_samples`` is the number of windows, ``max_seq_length`` the window length (so truncation removes
nothing), and the samples are not shuffled (their order does not change a Hessian or an activation mean, only the
float rounding). A recording collator checks that the calibration pass over the dataloader collated exactly these
windows (the sequential pipeline collates one batch before it, only to trace the model's graph).

Recipes, everything not named here left at llm-compressor's defaults (recorded in --info):
    gptq: GPTQModifier(config_groups={W{bits} int, symmetric, strategy group, group_size}, targets Linear,
          ignore lm_head)
    awq:  AWQModifier() followed by QuantizationModifier(same config_groups, asymmetric), the non-deprecated
          spelling of AWQModifier(scheme=..., ignore=["lm_head"]).

On a machine without an accelerator, llm-compressor 0.13.0 and 0.14.x stop in AWQ's smoothing step:
``AWQModifier._apply_smoothing`` pins every cached activation (``IntermediatesCache.pin_memory``, "for faster
onloading during grid search") and torch raises "RuntimeError: Cannot access accelerator device when none is
available." ``--no-pin-memory`` replaces that one method by a no-op when no accelerator is present: pinning only
changes which host allocator holds a copy of the same values, so the algorithm and its numbers are unchanged; the
patch is recorded in --info (``patches``). Without the flag the run fails as released.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

CALIBRATION_FORMAT = "quantkit-calibration/1"


def load_windows(path: Path):
    import torch
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        ids = f.get_tensor("input_ids").to(torch.int64)
    if metadata.get("format") != CALIBRATION_FORMAT:
        sys.exit(f"'{path}' is not a quantkit calibration file (metadata format {metadata.get('format')!r})")
    return ids, metadata


def fingerprint(ids) -> str:
    """As quantkit's CalibrationSet.fingerprint: sha256 of the int64 [windows, seq_len] bytes, 16 hex digits."""
    return hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]


class RecordingCollator:
    """llm-compressor's own 'truncation' collator, keeping a copy of every window it batches."""

    def __init__(self, max_seq_length: int) -> None:
        from llmcompressor.datasets.utils import DataCollatorWithTruncation

        self.inner = DataCollatorWithTruncation(max_seq_length)
        self.rows: list[tuple[int, ...]] = []

    def __call__(self, features, return_tensors: str = "pt"):
        batch = self.inner(features, return_tensors)
        self.rows.extend(tuple(row) for row in batch["input_ids"].tolist())
        return batch


def weight_scheme(bits: int, group_size: int, symmetric: bool) -> dict:
    return {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": bits,
                "type": "int",
                "symmetric": symmetric,
                "strategy": "group",
                "group_size": group_size,
            },
        }
    }


def build_recipe(method: str, bits: int, group_size: int) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if method == "gptq":
        return [GPTQModifier(config_groups=weight_scheme(bits, group_size, True), ignore=["lm_head"])]
    from llmcompressor.modifiers.transform.awq import AWQModifier

    return [
        AWQModifier(),
        QuantizationModifier(config_groups=weight_scheme(bits, group_size, False), ignore=["lm_head"]),
    ]


def modifier_settings(recipe: list) -> list[dict]:
    """Each modifier's public fields as used (defaults included), JSON-safe."""
    out = []
    for modifier in recipe:
        fields = {}
        for name in type(modifier).model_fields:
            if name.startswith("_"):
                continue
            value = getattr(modifier, name, None)
            try:
                json.dumps(value)
            except TypeError:
                value = repr(value)
            fields[name] = value
        out.append({"modifier": type(modifier).__name__, "fields": fields})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="float model directory (config.json)")
    parser.add_argument("--calib", required=True, type=Path, help="`quantkit calibrate` safetensors file")
    parser.add_argument("--method", required=True, choices=("gptq", "awq"))
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="model load dtype: auto (the checkpoint's), float32, bfloat16")
    parser.add_argument("--output", required=True, type=Path, help="checkpoint directory to write")
    parser.add_argument("--info", required=True, type=Path, help="JSON file: versions, settings, timings")
    parser.add_argument(
        "--no-pin-memory",
        action="store_true",
        help="without an accelerator: make IntermediatesCache.pin_memory a no-op (AWQ fails on CPU otherwise)",
    )
    args = parser.parse_args()

    start = time.perf_counter()
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    patches = []
    if args.no_pin_memory and not torch.accelerator.is_available():
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
        patches.append("IntermediatesCache.pin_memory -> no-op (no accelerator; values unchanged)")
    ids, metadata = load_windows(args.calib)
    windows, seq_len = ids.shape
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    recipe = build_recipe(args.method, args.bits, args.group_size)
    collator = RecordingCollator(seq_len)
    loaded = time.perf_counter()
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=recipe,
        num_calibration_samples=windows,
        max_seq_length=seq_len,
        shuffle_calibration_samples=False,
        data_collator=collator,
    )
    calibrated = time.perf_counter()
    args.output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.output, save_compressed=True)
    tokenizer.save_pretrained(args.output)
    saved = time.perf_counter()

    expected = sorted(tuple(row) for row in ids.tolist())
    last_pass = sorted(collator.rows[-len(expected) :])  # the calibration pass over the dataloader
    info = {
        "versions": {
            name: version(name) for name in ("llmcompressor", "compressed-tensors", "torch", "transformers", "datasets")
        },
        "method": args.method,
        "dtype": str(model.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "patches": patches,
        "recipe": modifier_settings(recipe),
        "calibration": {
            "file": str(args.calib),
            "windows": int(windows),
            "seq_len": int(seq_len),
            "fingerprint": fingerprint(ids),
            "source": metadata.get("source"),
            # the sequential pipeline also collates one batch first to trace the model (no statistics from it)
            "windows_collated": len(collator.rows),
            "same_windows_fed": last_pass == expected and set(collator.rows) <= set(expected),
            "same_order": collator.rows[-len(expected) :] == [tuple(row) for row in ids.tolist()],
        },
        "seconds": {
            "load": loaded - start,
            "oneshot": calibrated - loaded,
            "save": saved - calibrated,
            "total": saved - start,
        },
    }
    args.info.write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
