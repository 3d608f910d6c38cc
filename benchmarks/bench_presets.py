"""The GPU-serving presets (FP8, W8A8, NVFP4, MX) side by side with llm-compressor's on the same model, windows and
evaluation: size, bits per weight, time, perplexity change, KL divergence, top-1 agreement, and whether the
checkpoint's layout (layer 0's tensor names, dtypes and shapes; the quantization_config's scheme keys) equals
llm-compressor's.

llm-compressor's checkpoints are references written once in its own virtual environment by
benchmarks/llmc_worker.py (see benchmarks/llmc_presets.py for the commands; ``--llmc-ref`` is their directory,
one sub-directory per preset plus ``NAME.info.json`` with its timings). The NVFP4 GPTQ references:

    $W --method preset-gptq --scheme NVFP4A16 --calib CALIB --output REF/NVFP4A16_GPTQ \\
        --info REF/NVFP4A16_GPTQ.info.json

quantkit quantizes each case in a subprocess (wall clock and peak RSS measured here) from the same calibration
file. Every checkpoint, both libraries', is then scored in this process by the same code: quantkit's loader (inputs
and the KV cache quantized as the serving kernel does) on the first ``--eval-windows`` 512-token windows of
held-out Persuasion (no BOS: SmolLM2's tokenizer has none), against the float model's logits computed once.

    python -m benchmarks.bench_presets --llmc-ref /work/tmp/llmc-ref-ct020 --calib CALIB --json presets.json \
        --record presets
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.bench_llmcompressor import quantkit_cmd, read_quant_config, run, safetensors_mb, tail
from benchmarks.llmc_presets import checkpoint_tensors
from benchmarks.record import record_table

console = Console(width=160)
LAYER0 = "model.layers.0."
SCHEME_KEYS = ("format", "weights", "input_activations")  # per config group; observers are each library's choice
IGNORED_ARG_KEYS = ("observer", "observer_kwargs", "actorder")  # solver choices: no stored tensor differs


@dataclass(frozen=True)
class Case:
    """One quantkit run and the llm-compressor references it is compared with."""

    label: str
    args: tuple[str, ...]
    llmc: tuple[str, ...] = ()  # reference directory names under --llmc-ref
    calibrated: bool = True  # False: data-free, the shared calibration file is not given


SELF_CALIBRATION = ("--dataset", "self", "--num-samples", "8", "--seq-len", "256")  # data-free: the model's text
CASES = (
    Case(
        "FP8_DYNAMIC",
        ("--scheme", "FP8_DYNAMIC", "--method", "gptq", *SELF_CALIBRATION),
        ("FP8_DYNAMIC",),
        calibrated=False,
    ),
    Case("FP8_DYNAMIC rtn", ("--scheme", "FP8_DYNAMIC", "--method", "rtn", "--mse-clip"), calibrated=False),
    Case("FP8", ("--scheme", "FP8", "--method", "gptq"), ("FP8",)),
    Case("FP8 + KV fp8", ("--scheme", "FP8", "--method", "gptq", "--kv-cache-scheme", "fp8"), ("FP8_KV",)),
    Case(
        "FP8 + KV fp8-head",
        ("--scheme", "FP8", "--method", "gptq", "--kv-cache-scheme", "fp8-head"),
        ("FP8_KV_HEAD",),
    ),
    Case("W8A8", ("--scheme", "W8A8", "--method", "smoothquant+gptq"), ("W8A8_SQ_GPTQ", "W8A8")),
    Case("NVFP4A16", ("--scheme", "NVFP4A16", "--method", "gptq"), ("NVFP4A16", "NVFP4A16_GPTQ")),
    Case("NVFP4", ("--scheme", "NVFP4", "--method", "gptq"), ("NVFP4", "NVFP4_GPTQ")),
    Case("MXFP4A16", ("--scheme", "MXFP4A16", "--method", "gptq"), ("MXFP4A16",)),
    Case("MXFP4", ("--scheme", "MXFP4", "--method", "gptq"), ("MXFP4",)),
    Case("MXFP8A16", ("--scheme", "MXFP8A16", "--method", "gptq"), ("MXFP8A16",)),
    Case("MXFP8", ("--scheme", "MXFP8", "--method", "gptq"), ("MXFP8",)),
    Case("W4A16 g32", ("--scheme", "W4A16", "--group-size", "32", "--method", "gptq")),
)


@dataclass
class Row:
    case: str
    library: str
    recipe: str
    checkpoint: str
    seconds: float | None = None
    seconds_source: str = ""
    peak_rss_mb: float | None = None
    size_mb: float | None = None
    bits_per_weight: float | None = None
    perplexity: float | None = None
    perplexity_change_pct: float | None = None
    kl_mean: float | None = None
    kl_p99: float | None = None
    top1: float | None = None
    layout: str = ""
    error: str | None = None
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# Layouts: what a checkpoint stores, compared with llm-compressor's
# --------------------------------------------------------------------------------------------------


def layer0_tensors(directory: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Layer 0's tensors: name suffix -> (safetensors dtype, shape)."""
    return {
        name.removeprefix(LAYER0): (entry["dtype"], tuple(entry["shape"]))
        for name, (_, entry) in checkpoint_tensors(directory).items()
        if name.startswith(LAYER0)
    }


def scheme_keys(quant_config: dict | None) -> dict:
    """The scheme as the quantization_config states it, minus each library's calibration choices."""
    config = quant_config or {}
    groups = []
    for group in (config.get("config_groups") or {}).values():
        kept = {}
        for key in SCHEME_KEYS:
            value = group.get(key)
            if isinstance(value, dict):
                value = {k: v for k, v in value.items() if k not in IGNORED_ARG_KEYS}
            kept[key] = value
        groups.append(kept)
    return {"groups": groups, "format": config.get("format"), "kv_cache_scheme": config.get("kv_cache_scheme")}


def layout_difference(ours: Path, theirs: Path) -> list[str]:
    """What differs between two checkpoints' layer-0 tensors and scheme keys (empty: the same layout)."""
    differences = []
    a, b = layer0_tensors(ours), layer0_tensors(theirs)
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            differences.append(f"{name}: quantkit {a.get(name)} vs llm-compressor {b.get(name)}")
    mine, other = scheme_keys(read_quant_config(ours)), scheme_keys(read_quant_config(theirs))
    for key in mine:
        if mine[key] != other[key]:
            differences.append(f"quantization_config {key}: quantkit {mine[key]} vs llm-compressor {other[key]}")
    return differences


# --------------------------------------------------------------------------------------------------
# Scoring: every checkpoint against the float model's logits, computed once
# --------------------------------------------------------------------------------------------------


class Scorer:
    """The float model's logits on the evaluation windows, kept, and each checkpoint scored against them."""

    def __init__(self, model: str, windows: int, seq_len: int = 512) -> None:
        from quantkit.data.sources import DEFAULT_EVALUATION, load_documents
        from quantkit.data.tokens import bos_prefix, encode_documents, join_documents
        from quantkit.eval.evaluate import make_windows, model_logits_fn
        from quantkit.model.resolve import load_model, load_tokenizer

        tokenizer = load_tokenizer(model)
        docs = load_documents(str(DEFAULT_EVALUATION))
        stream = join_documents(encode_documents(tokenizer, docs.texts, show_progress=False), tokenizer.eos_token_id)
        prefix = bos_prefix(tokenizer)
        self.windows = make_windows(stream, seq_len, seq_len - len(prefix), prefix, windows)
        reference = model_logits_fn(load_model(model))
        with torch.inference_mode():
            self.reference = [reference(self._ids(w))[0] for w in self.windows]

    @staticmethod
    def _ids(window) -> torch.Tensor:
        return torch.tensor([window.input_ids], dtype=torch.long)

    def score(self, checkpoint: Path) -> dict:
        from quantkit.eval.evaluate import model_logits_fn, perplexity_change_pct
        from quantkit.eval.logit_metrics import RunningMetrics
        from quantkit.model.resolve import load_model

        logits_of = model_logits_fn(load_model(checkpoint))
        metrics = RunningMetrics()
        with torch.inference_mode():
            for window, reference in zip(self.windows, self.reference, strict=True):
                first = window.first_scored
                ids = self._ids(window)
                metrics.add_window(logits_of(ids)[0, first - 1 : -1], ids[0, first:], reference[first - 1 : -1])
        kl_mean, kl_p99, top1 = metrics.kl_summary()
        return {
            "perplexity": metrics.perplexity,
            "reference_perplexity": metrics.reference_perplexity,
            "perplexity_change_pct": perplexity_change_pct(metrics.perplexity, metrics.reference_perplexity),
            "kl_mean": kl_mean,
            "kl_p99": kl_p99,
            "top1": top1,
            "tokens": metrics.tokens,
        }


# --------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------


def parameter_count(model: str) -> int:
    from quantkit.model.resolve import resolve_model

    total = 0
    for _, (_, entry) in checkpoint_tensors(resolve_model(model)).items():
        count = 1
        for size in entry["shape"]:
            count *= size
        total += count
    return total


def quantkit_row(case: Case, model: str, calib: Path, out: Path) -> Row:
    checkpoint = out / case.label.replace(" ", "_").replace("+", "plus")
    calibration = ("--calib", calib) if case.calibrated else ()
    args = ("quantize", model, "-o", checkpoint, *calibration, "--force", *case.args)
    done = run(quantkit_cmd(*args), checkpoint.with_name(checkpoint.name + ".log"))
    row = Row(case.label, "quantkit", " ".join(case.args), str(checkpoint))
    row.seconds, row.seconds_source, row.peak_rss_mb = done.seconds, "this run (whole process)", done.peak_rss_mb
    if done.returncode != 0:
        row.error = tail(done.log, 3)
    return row


def llmc_row(case: Case, reference: str, root: Path) -> Row:
    checkpoint = root / reference
    info_file = root / f"{reference}.info.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    recipe = ", ".join(m.get("modifier", "?") for m in info.get("recipe", [])) or "?"
    row = Row(case.label, "llm-compressor", f"{reference}: {recipe}", str(checkpoint), extra={"info": info})
    row.seconds = (info.get("seconds") or {}).get("total")
    row.seconds_source = "its own run (NAME.info.json: load + oneshot + save)"
    if not (checkpoint / "config.json").is_file():
        row.error = info.get("error", "no checkpoint")
    return row


def fill_scores(row: Row, scorer: Scorer, parameters: int) -> None:
    if row.error:
        return
    checkpoint = Path(row.checkpoint)
    row.size_mb = safetensors_mb(checkpoint)
    row.bits_per_weight = row.size_mb * 1e6 * 8 / parameters
    try:
        scores = scorer.score(checkpoint)
    except Exception as error:  # a checkpoint quantkit's loader cannot run is a row, not the end of the run
        row.error = f"{type(error).__name__}: {error}"
        return
    row.perplexity, row.perplexity_change_pct = scores["perplexity"], scores["perplexity_change_pct"]
    row.kl_mean, row.kl_p99, row.top1 = scores["kl_mean"], scores["kl_p99"], scores["top1"]
    row.extra["reference_perplexity"] = scores["reference_perplexity"]
    row.extra["tokens"] = scores["tokens"]


def calibration_summary(path: Path) -> str:
    """``N x L tokens of SOURCE``, from the calibration file's own metadata."""
    from quantkit.data.calibration import CalibrationSet

    calibration = CalibrationSet.load(path)
    windows, length = calibration.input_ids.shape
    return f"{windows} x {length} tokens of {calibration.metadata.get('source', path.name)}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_rows(rows: list[Row]) -> list[list[str]]:
    return [
        [
            r.case,
            r.library,
            r.recipe if r.library == "quantkit" else r.recipe.split(":")[0],
            _fmt(r.size_mb, ".1f"),
            _fmt(r.bits_per_weight, ".2f"),
            _fmt(r.seconds, ".0f"),
            _fmt(r.perplexity, ".3f"),
            "-" if r.perplexity_change_pct is None else f"{r.perplexity_change_pct:+.2f}%",
            _fmt(r.kl_mean, ".4f"),
            _fmt(r.top1, ".3f"),
            r.layout or (r.error or "")[:60],
        ]
        for r in rows
    ]


COLUMNS = ["preset", "library", "recipe", "size MB", "bits/w", "time s", "ppl", "ppl +%", "KL mean", "top-1", "layout"]


NOTES = [
    "layout: layer 0's tensor names, dtypes and shapes and the quantization_config's scheme keys "
    "(observers and act-order aside) compared with quantkit's checkpoint of the same preset.",
    "FP8_DYNAMIC: quantkit's rows read no text. `--dataset self` runs GPTQ on windows the model wrote "
    "itself; `rtn` reads nothing at all. llm-compressor's FP8_DYNAMIC is data-free round-to-nearest.",
    "llm-compressor's NAME_GPTQ rows are its GPTQModifier with the preset as scheme; its other rows are "
    "QuantizationModifier (round-to-nearest, calibrated input, global and KV scales); W8A8_SQ_GPTQ is "
    "SmoothQuantModifier(smoothing_strength=0.8) then GPTQModifier.",
]


def protocol_text(calib: Path, eval_windows: int) -> str:
    return (
        f"SmolLM2-135M-Instruct; both libraries calibrate on the same windows ({calibration_summary(calib)}); "
        f"every checkpoint scored by the same code on the first {eval_windows} windows of 512 tokens of held-out "
        "Persuasion (no BOS), inputs and KV cache quantized as the serving kernel does. quantkit's time is its "
        "whole process in this run; llm-compressor's is from its own run (load, oneshot, save)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calib", type=Path, required=True, help="the calibration file llm-compressor used")
    parser.add_argument("--llmc-ref", type=Path, required=True, help="llm-compressor's reference checkpoints")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_presets"), help="quantkit's checkpoints")
    parser.add_argument("--cases", help="comma-separated case labels (default: all)")
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--record", help="record the table as benchmarks/results/NAME.json")
    args = parser.parse_args()

    wanted = None if args.cases is None else {c.strip() for c in args.cases.split(",")}
    cases = [c for c in CASES if wanted is None or c.label in wanted]
    started = time.perf_counter()
    rows: list[Row] = []
    for case in cases:  # every quantize run first, alone on the machine, then the scoring
        rows.append(quantkit_row(case, args.model, args.calib, args.out))
        rows += [llmc_row(case, reference, args.llmc_ref) for reference in case.llmc]
    scorer = Scorer(args.model, args.eval_windows)
    parameters = parameter_count(args.model)
    for row in rows:
        fill_scores(row, scorer, parameters)
        console.print(f"{row.case} / {row.library}: ppl {_fmt(row.perplexity, '.3f')} {row.error or ''}")
    ours = {r.case: r for r in rows if r.library == "quantkit"}
    for row in rows:
        if row.library == "llm-compressor" and not row.error and not ours[row.case].error:
            differences = layout_difference(Path(ours[row.case].checkpoint), Path(row.checkpoint))
            row.layout = "same as quantkit's" if not differences else f"{len(differences)} differences"
            row.extra["layout_differences"] = differences
    reference_ppl = next((r.extra.get("reference_perplexity") for r in rows if "reference_perplexity" in r.extra), None)

    table = Table(title=f"Presets vs llm-compressor (float ppl {_fmt(reference_ppl, '.3f')})")
    for column in COLUMNS:
        table.add_column(column)
    for cells in table_rows(rows):
        table.add_row(*cells)
    console.print(table)
    if args.json:
        payload = {
            "rows": [asdict(r) for r in rows],
            "reference_perplexity": reference_ppl,
            "eval_windows": args.eval_windows,
            "command": shlex.join([sys.executable, "-m", "benchmarks.bench_presets", *sys.argv[1:]]),
            "seconds": time.perf_counter() - started,
        }
        args.json.write_text(json.dumps(payload, indent=1, default=str))
    if args.record:
        record_table(
            args.record,
            title="GPU-serving presets side by side with llm-compressor",
            order=35,
            protocol=protocol_text(args.calib, args.eval_windows),
            baseline=f"the float model (ppl {_fmt(reference_ppl, '.3f')}) and llm-compressor 0.14 on the same preset",
            columns=COLUMNS,
            rows=table_rows(rows),
            notes=NOTES,
        )


if __name__ == "__main__":
    main()
