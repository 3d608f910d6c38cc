"""The model card every checkpoint gets (README.md): the Hugging Face Hub's metadata block (base_model with the
``quantized`` relation, library_name, pipeline_tag, tags, the base model's license), then the scheme, the method,
the calibration data, the size, the coverage audit's summary, where it loads and how, and an evaluation section a
recipe run fills (:func:`with_evaluation`), so a checkpoint pushed to a hub explains itself.

The card holds no path of this machine and no time: two runs of one job write the same card."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from quantkit import __version__
from quantkit.format.coverage import CoverageAudit
from quantkit.format.coverage_table import coverage_markdown, markdown_table
from quantkit.format.files import MODEL_CARD
from quantkit.format.inspect import CheckpointReport
from quantkit.format.presets import PRESETS
from quantkit.format.scheme import QuantScheme
from quantkit.format.sizes import format_mb
from quantkit.model.resolve import hub_id_of
from quantkit.quantization.job import QuantizeJob

EVAL_START = "<!-- quantkit:evaluation -->"  # a recipe run replaces what lies between the markers
EVAL_END = "<!-- /quantkit:evaluation -->"
NOT_EVALUATED = (
    "Not evaluated yet: `quantkit eval` measures it against the base model; a recipe run writes its figures here."
)
_CARRIED = ("license", "license_name", "license_link", "language")  # from the base model's card: still its terms
_LIBRARY = "transformers"  # what loads it on the Hub's "use this model" (compressed-tensors' integration)


def preset_of(scheme: QuantScheme) -> str | None:
    """The compressed-tensors preset whose storage layout ``scheme`` is (solver options aside), if any."""
    layout = dataclasses.replace(scheme, act_order=False, static_groups=False, mse_clip=False)
    return next((name for name, found in PRESETS.items() if found == layout), None)


def format_tag(scheme: QuantScheme) -> str:
    """The weights' number format as the Hub's tags spell it: int4, fp8, nvfp4, mxfp4, mxfp8."""
    if not scheme.is_float:
        return f"int{scheme.bits}"
    return {"fp8": "nvfp", "e8m0": "mxfp"}.get(scheme.scale_format, "fp") + str(scheme.bits)


def model_card(job: QuantizeJob, log: dict[str, Any], audit: CoverageAudit, report: CheckpointReport) -> str:
    """The card of the checkpoint ``job`` wrote: ``log`` its run log, ``audit`` its coverage, ``report`` what
    ``inspect`` reads from it."""
    base = hub_id_of(job.model, job.source)
    planned = job.config.planned is not None
    preset = None if planned else preset_of(job.config.resolved_scheme())
    label = "mixed precision" if planned else preset or job.config.resolved_scheme().name
    meta: dict[str, Any] = {"base_model": base, "base_model_relation": "quantized"} if base else {}
    meta |= {key: value for key, value in _base_card(job.source).items() if key in _CARRIED}
    written = list(dict.fromkeys(s for s in job.assignment.schemes.values() if s is not None))
    tags = ["quantkit", "compressed-tensors", *([preset.lower()] if preset else []), *map(format_tag, written)]
    meta |= {"library_name": _LIBRARY, "pipeline_tag": "text-generation", "tags": list(dict.fromkeys(tags))}
    name = base.rpartition("/")[2] if base else job.source.name
    origin = f"[{base}](https://huggingface.co/{base})" if base else f"The local model `{job.source.name}`"
    lines = [
        "---",
        yaml.safe_dump(meta, sort_keys=False, default_flow_style=False, width=1000).rstrip(),
        "---",
        "",
        f"# {name}, {label} ({job.config.method})",
        "",
        f"{origin} quantized by quantkit {__version__} with {job.config.method}, in the compressed-tensors format",
        "(where it loads: see Use).",
        "",
        "## Quantization",
        "",
        *markdown_table(["", ""], _facts(job, log, report, label)),
        "",
        "## Coverage",
        "",
        *coverage_markdown(audit),
        "",
        *_loading(report),
        "## Evaluation",
        "",
        EVAL_START,
        NOT_EVALUATED,
        EVAL_END,
        "",
    ]
    return "\n".join(lines)


def _facts(job: QuantizeJob, log: dict[str, Any], report: CheckpointReport, label: str) -> list[list[str]]:
    schemes = "; ".join(
        f"{g.scheme}: {g.weights}, {g.activations} activations ({g.layers} linears)" for g in report.groups
    )
    return [
        ["scheme", label],
        ["written as", schemes],
        ["algorithms", ", ".join(log.get("solvers") or {}) or "-"],
        ["calibration", _calibration(log)],
        ["KV cache", report.kv_cache],
        [
            "bits per weight",
            f"{report.avg_bits_per_weight:.3f} (quantized linears); {report.model_bits_per_weight:.3f} (whole model)",
        ],
        ["size", f"{format_mb(report.checkpoint_bytes)} of safetensors"],
    ]


def _calibration(log: dict[str, Any]) -> str:
    """The windows and where they came from; a local file by its name only (the card leaves this machine)."""
    meta, shape = log.get("calibration"), log.get("calibration_shape")
    if not meta or not shape:
        return "none (data-free)"
    source = str(meta.get("source", "?"))
    if Path(source).is_absolute() or source.startswith("."):
        source = f"local file {Path(source).name}"
    params = json.loads(meta.get("params") or "{}")
    seed = f", seed {params['seed']}" if "seed" in params else ""
    return f"{shape[0]} windows x {shape[1]} tokens from {source}{seed}"


def _loading(report: CheckpointReport) -> list[str]:
    rows = [[v.engine, "yes" if v.loads else "no", v.summary] for v in report.loads_in]
    return [
        "## Use",
        "",
        *markdown_table(["engine", "loads", "kernels / why not"], rows),
        "",
        "transformers (with the `compressed-tensors` package installed):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'path = "path/to/this/checkpoint"  # or its Hub id once pushed',
        'model = AutoModelForCausalLM.from_pretrained(path, device_map="auto")',
        "tokenizer = AutoTokenizer.from_pretrained(path)",
        "```",
        "",
        "vLLM, or quantkit's own runtime:",
        "",
        "```bash",
        "vllm serve path/to/this/checkpoint",
        "quantkit serve path/to/this/checkpoint",
        "```",
        "",
    ]


def _base_card(source: Path) -> dict[str, Any]:
    """The metadata block of the base model's own card, if it has one that parses."""
    card = Path(source) / MODEL_CARD
    return front_matter(card.read_text(errors="replace")) if card.is_file() else {}


def front_matter(text: str) -> dict[str, Any]:
    """The YAML block between the leading ``---`` lines of a card; {} without one or when it does not parse."""
    if not text.startswith("---\n"):
        return {}
    end = text.find("\n---", 4)
    try:
        data = yaml.safe_load(text[4:end]) if end > 0 else None
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def with_evaluation(card: str, lines: list[str]) -> str:
    """``card`` with its evaluation section's body replaced by ``lines`` (appended as a new section when the markers
    were edited away)."""
    body = "\n".join([EVAL_START, *lines, EVAL_END])
    start, end = card.find(EVAL_START), card.find(EVAL_END)
    if start < 0 or end < start:
        return card.rstrip("\n") + "\n\n## Evaluation\n\n" + body + "\n"
    return card[:start] + body + card[end + len(EVAL_END) :]
