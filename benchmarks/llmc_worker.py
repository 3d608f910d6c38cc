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

Reference checkpoints for the compressed-tensors preset schemes (benchmarks/llmc_presets.py reads them):

    preset:  QuantizationModifier(targets Linear, scheme=--scheme (a PRESET_SCHEMES name: FP8, NVFP4, MXFP4, ...),
             ignore lm_head), kv_cache_scheme from --kv-cache (FP8 E4M3, symmetric, static; strategy tensor or
             attn_head), bypass_divisibility_checks from --bypass-divisibility
    sq-gptq: SmoothQuantModifier(smoothing_strength=--smoothing-strength) then GPTQModifier(targets Linear,
             scheme=--scheme, ignore lm_head)

--calib is optional for preset (data-free schemes: weight-only or dynamic activations); without it oneshot gets no
dataset. When oneshot or the save fails, --info still gets the versions, the recipe and ``error`` (exception type,
message, the innermost frame) and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import time
import traceback
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


def kv_cache_args(strategy: str | None):
    """FP8 (E4M3) KV cache, symmetric, static scales from calibration: one per tensor or one per head."""
    if strategy is None:
        return None
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=8, type="float", strategy=strategy, dynamic=False, symmetric=True)


def build_recipe(method: str, bits: int, group_size: int, args: argparse.Namespace | None = None) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if method == "preset":
        return [
            QuantizationModifier(
                targets="Linear",
                scheme=args.scheme,
                ignore=["lm_head"],
                kv_cache_scheme=kv_cache_args(args.kv_cache),
                bypass_divisibility_checks=args.bypass_divisibility,
            )
        ]
    if method == "sq-gptq":
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        return [
            SmoothQuantModifier(smoothing_strength=args.smoothing_strength),
            GPTQModifier(targets="Linear", scheme=args.scheme, ignore=["lm_head"]),
        ]
    if method == "preset-gptq":
        return [GPTQModifier(targets="Linear", scheme=args.scheme, ignore=["lm_head"])]
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
            if hasattr(value, "model_dump"):  # QuantizationArgs (kv_cache_scheme)
                value = value.model_dump(mode="json")
            try:
                json.dumps(value)
            except TypeError:
                value = repr(value)
            fields[name] = value
        out.append({"modifier": type(modifier).__name__, "fields": fields})
    return out


@contextlib.contextmanager
def failure_recorded(path: Path, info: dict):
    """On an exception: write ``info`` with the error to ``path`` and exit with status 1 (traceback on stderr)."""
    try:
        yield
    except Exception as exc:
        traceback.print_exc()
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        info["error"] = {
            "type": type(exc).__name__,
            "message": str(exc),
            "where": f"{frame.filename}:{frame.lineno} in {frame.name}",
        }
        path.write_text(json.dumps(info, indent=2))
        sys.exit(1)


def save_compressed(args: argparse.Namespace, model, tokenizer, info: dict) -> None:
    """The checkpoint as llm-compressor writes it (compressed-tensors)."""
    with failure_recorded(args.info, info):
        args.output.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(args.output, save_compressed=True)
        tokenizer.save_pretrained(args.output)


def run_data_free(args: argparse.Namespace, model, tokenizer, info: dict, start: float) -> None:
    """A preset without calibration data: oneshot(model, recipe) and save."""
    from llmcompressor import oneshot

    with failure_recorded(args.info, info):
        recipe = build_recipe(args.method, args.bits, args.group_size, args)
    info["recipe"] = modifier_settings(recipe)
    info["calibration"] = None
    loaded = time.perf_counter()
    with failure_recorded(args.info, info):
        oneshot(model=model, recipe=recipe)
    calibrated = time.perf_counter()
    save_compressed(args, model, tokenizer, info)
    saved = time.perf_counter()
    info["seconds"] = {
        "load": loaded - start,
        "oneshot": calibrated - loaded,
        "save": saved - calibrated,
        "total": saved - start,
    }
    args.info.write_text(json.dumps(info, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="float model directory (config.json)")
    parser.add_argument("--calib", type=Path, help="`quantkit calibrate` safetensors file (optional for preset)")
    parser.add_argument("--method", required=True, choices=("gptq", "awq", "preset", "preset-gptq", "sq-gptq"))
    parser.add_argument(
        "--scheme", help="preset / preset-gptq / sq-gptq: a compressed-tensors PRESET_SCHEMES name (FP8, NVFP4, ...)"
    )
    parser.add_argument("--kv-cache", choices=("tensor", "attn_head"), help="preset: FP8 KV cache scale strategy")
    parser.add_argument("--smoothing-strength", type=float, default=0.8, help="sq-gptq: SmoothQuant alpha")
    parser.add_argument(
        "--bypass-divisibility",
        action="store_true",
        help="preset: bypass_divisibility_checks=True (let a group size that does not divide in-features through)",
    )
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
    if args.calib is None and (args.method != "preset" or args.kv_cache):
        parser.error(f"--calib is required for --method {args.method}" + (" with --kv-cache" if args.kv_cache else ""))
    if args.method in ("preset", "preset-gptq", "sq-gptq") and not args.scheme:
        parser.error(f"--scheme is required for --method {args.method}")

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
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    info = {
        "versions": {
            name: version(name) for name in ("llmcompressor", "compressed-tensors", "torch", "transformers", "datasets")
        },
        "method": args.method,
        "scheme": args.scheme,
        "kv_cache": args.kv_cache,
        "dtype": str(model.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "patches": patches,
    }
    if args.calib is None:  # data-free preset
        run_data_free(args, model, tokenizer, info, start)
        return
    ids, metadata = load_windows(args.calib)
    windows, seq_len = ids.shape
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    with failure_recorded(args.info, info):
        recipe = build_recipe(args.method, args.bits, args.group_size, args)
    info["recipe"] = modifier_settings(recipe)
    collator = RecordingCollator(seq_len)
    loaded = time.perf_counter()
    with failure_recorded(args.info, info):
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
    save_compressed(args, model, tokenizer, info)
    saved = time.perf_counter()

    expected = sorted(tuple(row) for row in ids.tolist())
    last_pass = sorted(collator.rows[-len(expected) :])  # the calibration pass over the dataloader
    info |= {
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
