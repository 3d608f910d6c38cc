"""The commented starting recipe written by ``quantkit recipe new``."""

from __future__ import annotations

import re
from pathlib import Path

from quantkit.data.calibration import CalibrationConfig
from quantkit.device import DEFAULT_DEVICE
from quantkit.errors import QuantkitError
from quantkit.eval.evaluate import DEFAULT_EVAL_WINDOWS
from quantkit.format.presets import PRESETS
from quantkit.format.scheme import QuantScheme
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods.composition import DEFAULT_METHOD, parse_method

_TEMPLATE = """\
# quantkit recipe: run with `quantkit run THIS.yaml [--set key.path=value] [--report DIR]`.
# Check it with `quantkit recipe validate THIS.yaml`. Values may use ${VAR} or ${VAR:-default}.
# Relative paths are relative to the current directory. Exit status: 0 gates pass, 1 a gate fails, 2 bad input.

model: smollm2-135m            # local HF directory, hub id, or alias
device: @device@               # auto (cuda when there is a GPU, else cpu) | cpu | cuda | cuda:N

calibration:
  dataset: null                # file (.txt/.jsonl/.json/.parquet), directory, HF dataset; null: shipped corpus
  num_samples: @num_samples@   # windows
  seq_len: @seq_len@           # tokens per window
  seed: 0
  strategy: random             # random | document
  select: random               # random | diverse

quantization:
  scheme:
    preset: @preset@           # @presets@; the keys below win
    bits: 4                    # 2 | 3 | 4 | 8
    group_size: @group_size@   # 32, 64, 128 ... or -1 for per-channel
    symmetric: true            # omit: symmetric, asymmetric for AWQ
    act_order: true            # GPTQ: columns by descending Hessian diagonal (omit: on for gptq, awq+gptq)
    static_groups: true        # with act_order: groups in column order, no g_idx (omit: on)
    mse_clip: true             # Hessian-weighted range shrinking (omit: on for gptq)
  solvers:                     # one of rtn | gptq, and any of rotation {kind, seed}, awq {}, float_targets {},
    gptq:                      # tune {steps, lr}, head_refit {}; each runs at its place whatever the order written
      damp: @damp@             # damping (fraction of the mean Hessian diagonal)
      block_size: @block_size@ # lazy-update block size
  ignore: []                   # regexes of linears kept in float, e.g. ['layers\\.0\\.mlp']
  layout_policy: @layout@      # fallback (a smaller group where one does not divide) | strict (stop) | quantkit-only
  batch_size: @batch_size@     # calibration windows per forward pass
  compute_dtype: @compute@     # the forward passes' products: float32 | bfloat16 | auto (bfloat16 where native)
  # Instead of one scheme (remove `scheme` then): a per-layer plan under a budget ...
  # mixed:
  #   target_bits: 4.5         # or max_size_mb: 60
  #   candidates: [int4-g128, int4-g64, int4-g32, int8, fp16]
  #   pins: {'down_proj$': int8}
  #   mode: proxy              # proxy (fast) | hybrid (proxy scaled to KL per unit) | kl (slow)
  # ... or an existing plan from `quantkit plan`:
  # plan: plan.yaml

output:
  directory: ${QUANTKIT_OUT:-out}/smollm2-w4-gptq
  force: true                  # replace a checkpoint that no longer matches the recipe
  formats: [compressed-tensors] # add gptq (<directory>-gptq/) and/or gguf (<directory>.gguf)

evaluation:
  dataset: null                # null: held-out Persuasion text
  windows: @eval_windows@      # null: every window
  seq_len: 512
  reference: null              # null: the recipe's model (baseline perplexity, KL, top-1)
  # behaviour: true            # also greedy replies to the shipped chat prompts (needs a chat template)

gates:                         # each optional; a failing gate makes `quantkit run` exit 1
  max_ppl_increase_pct: 25.0   # quantized perplexity vs the reference's, in percent
  max_kl_mean: 0.25            # mean KL divergence from the reference (nats/token)
  min_top1_agreement: 0.75     # fraction of positions with the reference's top-1 token
  min_quantized_fraction: 1.0  # of the block linears' weights, the part written quantized (ignore lowers it)
  # max_checkpoint_mb: 113.2   # the whole checkpoint's safetensors files, in MB (10^6 bytes)
  # with evaluation.behaviour (the float model's own end rate on the shipped prompts is about 0.7):
  # min_end_rate: 0.6          # share of the checkpoint's replies that end within the token limit
  # max_repetition_increase: 0.05  # share of repeated 4-grams, the checkpoint's minus the reference's
  # min_first32_agreement: 0.15  # share of the first 32 reply tokens equal to the reference's
  # min_tag_close_rate: 0.9    # reasoning tags opened and closed (checked only where the template has them)

smoke:
  enabled: false               # serve the checkpoint and check greedy output against the offline engine
  prompts: null                # null: the smoke test's default prompts
  max_tokens: 16
"""


_DEFAULTS = {  # written in the configs that use them
    "num_samples": CalibrationConfig.num_samples,
    "seq_len": CalibrationConfig.seq_len,
    "group_size": QuantScheme.group_size,
    "preset": next(name for name, scheme in PRESETS.items() if scheme == QuantScheme()),
    "presets": " | ".join(PRESETS),
    "damp": parse_method(DEFAULT_METHOD)[0].damp,
    "block_size": parse_method(DEFAULT_METHOD)[0].block_size,
    "layout": QuantizeConfig.layout_policy,
    "batch_size": QuantizeConfig.batch_size,
    "compute": QuantizeConfig.compute_dtype,
    "device": DEFAULT_DEVICE,
    "eval_windows": DEFAULT_EVAL_WINDOWS,
}
# "@name@" and the spaces after it take the default, left-aligned in the same width (the comments stay aligned)
STARTER = re.sub(r"@(\w+)@ *", lambda m: f"{_DEFAULTS[m.group(1)]}".ljust(len(m.group(0))), _TEMPLATE)


def write_starter(path: Path | None, *, force: bool = False) -> str:
    """The starter text; also written to ``path`` when given (never over an existing file without force)."""
    if path is not None:
        if path.exists() and not force:
            raise QuantkitError(f"'{path}' exists; pass --force to overwrite it or choose another -o")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(STARTER)
    return STARTER
