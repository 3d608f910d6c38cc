"""llm-compressor's own checkpoints for the compressed-tensors preset schemes: the layouts quantkit's writer matches.

For every reference checkpoint under --ref (one directory per preset, written by benchmarks/llmc_worker.py in
llm-compressor's virtual environment), this records:

- config.json's ``quantization_config`` in full;
- every tensor of decoder layer 0, and every tensor outside the layers that is not a plain copy of the float model
  (same name, dtype and shape): name suffix, safetensors dtype, shape, and for scales, zero points, global scales and
  shapes a few values with their min and max; plus how often each suffix occurs over all layers;
- whether transformers (this venv) loads and runs it with ``AutoModelForCausalLM.from_pretrained`` (its default
  compressed-tensors route: weights decompressed, input activations and the KV cache fake-quantized as configured;
  float32, or a bfloat16 load cast to float32 after decompression where float32 fails: ``route``),
  the largest |logit| difference against the float model on 2 short windows, and the perplexity on the first 4
  windows of 512 tokens of the held-out Persuasion text (the windows ``quantkit eval`` scores first);
- the checkpoint's size, llm-compressor's timings and versions (``NAME.info.json``), its error for a preset that
  failed, and ``quantkit eval``'s result (``NAME.eval.json``) or the last line of its log (``NAME.eval.log``).

Reproducing the references (llm-compressor 0.14 pins its own torch/transformers/compressed-tensors versions):

    python3 -m venv /work/tmp/llmc-venv
    /work/tmp/llmc-venv/bin/pip install torch==2.13.0          # first: the CPU build
    /work/tmp/llmc-venv/bin/pip install "llmcompressor==0.14.*" torch==2.13.0
    quantkit calibrate -o /work/tmp/llmc-ref/calib.safetensors --num-samples 32 --seq-len 256
    MODEL=$(python -c "from quantkit.model.resolve import resolve_model; print(resolve_model('smollm2-135m'))")
    W="/work/tmp/llmc-venv/bin/python benchmarks/llmc_worker.py --model $MODEL"
    $W --method preset --scheme FP8_DYNAMIC --output /work/tmp/llmc-ref/FP8_DYNAMIC \\
        --info /work/tmp/llmc-ref/FP8_DYNAMIC.info.json                      # data-free presets: no --calib
    $W --method preset --scheme NVFP4 --calib /work/tmp/llmc-ref/calib.safetensors ...   # FP8, NVFP4: static
    $W --method preset --scheme FP8 --kv-cache tensor --calib ... --output .../FP8_KV     # FP8_KV_HEAD: attn_head
    $W --method sq-gptq --scheme W8A8 --calib ... --output .../W8A8_SQ_GPTQ  # SmoothQuant 0.8, then GPTQ

Then, in quantkit's venv:

    python -m benchmarks.llmc_presets --ref /work/tmp/llmc-ref --json /work/tmp/llmc-ref/layouts.json
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from quantkit.data.sources import DEFAULT_EVALUATION, load_documents
from quantkit.data.tokens import bos_prefix, encode_documents, join_documents
from quantkit.eval.evaluate import Window, make_windows
from quantkit.eval.logit_metrics import token_nll
from quantkit.model.resolve import resolve_model

LAYER0 = "model.layers.0."
VALUED = ("scale", "zero_point", "shape", "g_idx")  # tensors whose values are recorded (a few of them)
console = Console(width=140)


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (name -> dtype, shape, data_offsets; ``__metadata__``)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def checkpoint_tensors(directory: Path) -> dict[str, tuple[Path, dict]]:
    """Every tensor of a checkpoint: name -> (file, header entry)."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, entry in safetensors_header(path).items():
            if name != "__metadata__":
                out[name] = (path, entry)
    return out


def sample_values(path: Path, name: str) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        tensor = f.get_tensor(name)
    flat = tensor.reshape(-1)
    as_float = flat.to(torch.float64) if flat.dtype != torch.bool else flat.to(torch.int64)
    values = [v if not float(v).is_integer() else int(v) for v in as_float[:4].tolist()]
    return {"first": values, "min": as_float.min().item(), "max": as_float.max().item()}


def describe_tensors(directory: Path, float_tensors: dict[str, tuple[Path, dict]]) -> dict:
    """Layer 0's tensors, the non-float-copy tensors outside the layers, and each layer suffix's count."""
    tensors = checkpoint_tensors(directory)
    layer0, outside, suffix_counts = [], [], {}
    for name, (path, entry) in tensors.items():
        row = {"name": name, "dtype": entry["dtype"], "shape": entry["shape"]}
        if name.startswith("model.layers."):
            suffix = name.split(".", 3)[3]
            suffix_counts[suffix] = suffix_counts.get(suffix, 0) + 1
            if not name.startswith(LAYER0):
                continue
            row["suffix"] = suffix
            target = layer0
        else:
            float_entry = float_tensors.get(name, (None, {}))[1]
            if (float_entry.get("dtype"), float_entry.get("shape")) == (entry["dtype"], entry["shape"]):
                continue  # a plain float copy (embeddings, final norm)
            row["suffix"] = name
            target = outside
        if any(key in row["suffix"] for key in VALUED):
            row["values"] = sample_values(path, name)
        target.append(row)
    missing = sorted(name for name in float_tensors if not name.startswith("model.layers.") and name not in tensors)
    return {
        "layer0": sorted(layer0, key=lambda r: r["suffix"]),
        "outside_layers": outside,
        "float_tensors_not_written": missing,
        "layer_suffix_counts": dict(sorted(suffix_counts.items())),
        "safetensors_metadata": {
            p.name: safetensors_header(p).get("__metadata__") for p in directory.glob("*.safetensors")
        },
    }


def eval_windows(tokenizer, seq_len: int, count: int) -> list[Window]:
    """The first ``count`` windows ``quantkit eval`` scores on the held-out Persuasion text."""
    docs = load_documents(str(DEFAULT_EVALUATION))
    stream = join_documents(encode_documents(tokenizer, docs.texts, show_progress=False), tokenizer.eos_token_id)
    prefix = bos_prefix(tokenizer)
    return make_windows(stream, seq_len, seq_len - len(prefix), prefix, count)


@torch.inference_mode()
def model_numbers(model, windows: list[Window], short: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Perplexity over ``windows`` and the logits on ``short`` [n, t]."""
    nll, tokens = 0.0, 0
    for window in windows:
        ids = torch.tensor([window.input_ids])
        logits = model(ids).logits[0]
        first = window.first_scored
        nll += token_nll(logits[first - 1 : -1], ids[0, first:]).sum().item()
        tokens += ids.shape[1] - first
    return math.exp(nll / tokens), model(short).logits.float()


def load_for_eval(directory: Path, dtype: torch.dtype, probe: torch.Tensor):
    """transformers' default compressed-tensors route in ``dtype``; the first forward decompresses the weights. A
    bfloat16 load is then cast to float32 (past transformers' guard on quantized models: the dequantized bfloat16
    weights are exact in float32), so every checkpoint is scored in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    with torch.no_grad():  # not inference_mode: the decompressed weights are cast afterwards
        model(probe)
    return torch.nn.Module.float(model) if dtype != torch.float32 else model


def transformers_check(directory: Path, windows, short, float_logits) -> dict:
    """Load and score in float32; where that fails (NVFP4/MX decompress to bfloat16 weights inside a float32
    model), load in bfloat16, decompress, cast to float32, and record both."""
    out: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        route = str(dtype).removeprefix("torch.")
        start = time.perf_counter()
        try:
            model = load_for_eval(directory, dtype, short[:, :8])
            loaded = time.perf_counter()
            perplexity, logits = model_numbers(model, windows, short)
        except Exception as exc:  # recorded, not raised: a checkpoint transformers refuses is a result
            out[f"{route}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            continue
        diff = (logits - float_logits).abs()
        return out | {
            "loads": True,
            "route": "float32" if dtype == torch.float32 else "bfloat16 load, decompressed, cast to float32",
            "load_seconds": loaded - start,
            "max_abs_dlogit": diff.max().item(),
            "mean_abs_dlogit": diff.mean().item(),
            "top1_agreement": (logits.argmax(-1) == float_logits.argmax(-1)).float().mean().item(),
            "perplexity": perplexity,
        }
    return out | {"loads": False, "error": out.get("bfloat16_error")}


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def quantkit_eval(ref: Path, name: str) -> dict | None:
    result = read_json(ref / f"{name}.eval.json")
    if result is not None:
        return {"ok": True, "result": result}
    log = ref / f"{name}.eval.log"
    if log.is_file():
        lines = [line.strip() for line in log.read_text().splitlines() if line.strip()]
        return {"ok": False, "last_lines": lines[-3:]}
    return None


def short_error(error: dict | None) -> dict | None:
    if not error:
        return None
    lines = [line for line in error["message"].splitlines() if line.strip()]
    return {
        "type": error["type"],
        "first_line": lines[0] if lines else "",
        "lines": len(lines),
        "where": error["where"],
    }


def dir_size(directory: Path) -> dict:
    weights = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    return {"safetensors_bytes": weights, "directory_bytes": sum(p.stat().st_size for p in directory.iterdir())}


def loads_text(check: dict) -> str:
    if not check:
        return ""
    return ("yes" if check["route"] == "float32" else "yes, bf16 load") if check["loads"] else "no"


def render(name: str, entry: dict) -> None:
    config = entry.get("quantization_config") or {}
    title = f"{name}  format={config.get('format')}"
    if entry.get("llmc_error"):
        console.print(f"[bold red]{name}: llm-compressor failed[/] {entry['llmc_error']['first_line'][:160]}")
        if not entry.get("tensors"):
            return
    check = entry.get("transformers") or {}
    if check.get("loads"):
        title += f"  ppl={check['perplexity']:.3f}  max|dlogit|={check['max_abs_dlogit']:.3f}"
    elif check:
        title += f"  transformers: {check['error'][:80]}"
    table = Table(title=title, title_justify="left")
    for column in ("tensor", "dtype", "shape", "values (first, min..max)"):
        table.add_column(column)
    tensors = entry["tensors"]
    for row in tensors["layer0"] + tensors["outside_layers"]:
        values = row.get("values")
        first = ", ".join(f"{v:.4g}" for v in values["first"]) if values else ""
        text = f"[{first}] {values['min']:.4g}..{values['max']:.4g}" if values else ""
        table.add_row(row["suffix"], row["dtype"], str(row["shape"]), text)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", type=Path, default=Path("/work/tmp/llmc-ref"), help="reference checkpoints")
    parser.add_argument("--json", type=Path, help="write every record here")
    parser.add_argument("--model", default="smollm2-135m", help="the float model the references were made from")
    parser.add_argument("--only", help="comma list of checkpoint names (default: every one under --ref)")
    parser.add_argument("--ppl-windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--no-load", action="store_true", help="skip transformers loading and perplexity")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    float_dir = resolve_model(args.model)
    float_tensors = checkpoint_tensors(float_dir)
    names = sorted({p.name.removesuffix(".info.json") for p in args.ref.glob("*.info.json")})
    names += sorted(p.name for p in args.ref.iterdir() if (p / "config.json").is_file() and p.name not in names)
    if args.only:
        names = [name for name in names if name in args.only.split(",")]
    record: dict = {"reference_dir": str(args.ref), "float_model": str(float_dir), "checkpoints": {}}
    if not args.no_load:
        torch.manual_seed(0)
        windows = eval_windows(AutoTokenizer.from_pretrained(float_dir), args.seq_len, args.ppl_windows)
        short = torch.tensor([w.input_ids[:64] for w in windows[:2]])  # 2 short windows: 64 tokens each
        model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
        perplexity, float_logits = model_numbers(model, windows, short)
        del model
        record["float"] = {"perplexity": perplexity, "dtype": "float32", "size": dir_size(float_dir)}
        record["eval"] = {"text": str(DEFAULT_EVALUATION), "ppl_windows": len(windows), "seq_len": args.seq_len}
        record["eval"]["logit_windows"] = list(short.shape)
        console.print(f"float model: perplexity {perplexity:.3f} on {len(windows)} x {args.seq_len} tokens")
    for name in names:
        directory = args.ref / name
        info = read_json(args.ref / f"{name}.info.json") or {}
        entry: dict = {
            "llmc_versions": info.get("versions"),
            "llmc_seconds": info.get("seconds"),
            "llmc_recipe": [
                {"modifier": m["modifier"], "scheme": m["fields"].get("scheme")} for m in info.get("recipe", [])
            ],
            "llmc_error": short_error(info.get("error")),
        }
        if (directory / "config.json").is_file() and any(directory.glob("*.safetensors")):
            config = json.loads((directory / "config.json").read_text())
            entry["quantization_config"] = config.get("quantization_config")
            entry["config_dtype"] = config.get("dtype", config.get("torch_dtype"))
            entry["tensors"] = describe_tensors(directory, float_tensors)
            entry["size"] = dir_size(directory)
            if not args.no_load:
                entry["transformers"] = transformers_check(directory, windows, short, float_logits)
        entry["quantkit_eval"] = quantkit_eval(args.ref, name)
        record["checkpoints"][name] = entry
        render(name, entry)
    summary = Table(title="summary (transformers in this venv, float32)")
    for column in ("checkpoint", "format", "loads", "max|dlogit|", "ppl", "MB", "llmc oneshot s", "llmc error"):
        summary.add_column(column)
    for name, entry in record["checkpoints"].items():
        check = entry.get("transformers") or {}
        seconds = entry.get("llmc_seconds") or {}
        summary.add_row(
            name,
            str((entry.get("quantization_config") or {}).get("format", "")),
            loads_text(check),
            f"{check['max_abs_dlogit']:.3f}" if check.get("loads") else "",
            f"{check['perplexity']:.3f}" if check.get("loads") else "",
            f"{entry['size']['safetensors_bytes'] / 1e6:.1f}" if entry.get("size") else "",
            f"{seconds['oneshot']:.1f}" if seconds else "",
            (entry["llmc_error"] or {}).get("type", ""),
        )
    console.print(summary)
    if "float" in record:
        console.print(f"float model perplexity: {record['float']['perplexity']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(record, indent=2))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
