"""Load a GPTQ export with a GPTQ stack quantkit did not write, and compare it with quantkit's own loader.

Exports CHECKPOINT (a quantkit checkpoint) with ``write_gptq`` (or takes ``--export DIR``, an export already made),
loads the export on CPU with GPTQModel's own loader (``--loader gptqmodel``, TorchLinear kernel) or transformers'
GPTQ integration (``--loader transformers``: optimum + gptqmodel), in float16 (``--dtype``; GPTQModel's torch kernel
runs float16/bfloat16 only), then prints:

- per quantized Linear, the weight as the stack decodes it (its unpacking, its v1 -> v2 zero-point conversion, its
  ``scales[g_idx] * (q - zeros[g_idx])``, evaluated in float32 so that fp16 rounding does not hide a wrong code)
  against ``QuantizedWeight.dequantize()``: bit-exact count and max abs difference;
- the max abs difference of the logits against ``quantkit.format.loader.load_quantized_model`` in float32 on a fixed
  text, next to quantkit's own loader in the stack's dtype (the rounding floor of that dtype), and the two
  in the same dtype against each other.

Needs gptqmodel (and optimum for ``--loader transformers``) in the running interpreter; both are pure-Python
packages. Run from the repository root (``-m`` puts it on the import path).

    python -m tools.check_gptq_export /work/tmp/w4g64 [--export DIR] [--loader transformers]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from quantkit.export.gptq import write_gptq
from quantkit.export.source import open_export_source
from quantkit.format.loader import load_quantized_model

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be"
)


def load_gptq(path: Path, loader: str, dtype: torch.dtype) -> torch.nn.Module:
    """The HF model of a GPTQ export, loaded by the third-party stack on CPU."""
    if loader == "gptqmodel":
        from gptqmodel import BACKEND, GPTQModel

        return GPTQModel.load(str(path), device="cpu", backend=BACKEND.TORCH, dtype=dtype).model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), device_map="cpu", dtype=dtype)


def stack_weight(module: torch.nn.Module) -> torch.Tensor:
    """[N, K] weight decoded by GPTQModel's generic path (PackableQuantLinear), with float32 scales."""
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear

    scales = module.scales
    module.scales = scales.float()
    try:
        return PackableQuantLinear.dequantize_weight(module).t().float()  # GPTQ decodes to [K, N]
    finally:
        module.scales = scales


def compare_weights(checkpoint: Path, model: torch.nn.Module) -> tuple[int, int, float]:
    """(bit-exact layers, layers, max abs difference) of the stack's decoded weights against the source's."""
    exact, total, worst = 0, 0, 0.0
    for prefix, qw in open_export_source(checkpoint).quantized_weights():
        theirs = stack_weight(model.get_submodule(prefix))
        ours = qw.dequantize(torch.float32)
        total += 1
        exact += int(torch.equal(theirs, ours))
        worst = max(worst, float((theirs - ours).abs().max()))
    return exact, total, worst


def input_ids(checkpoint: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(checkpoint))(TEXT, return_tensors="pt")["input_ids"]
    return ids[:, :64]


@torch.no_grad()
def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits.float()


def report(label: str, got: torch.Tensor, reference: torch.Tensor) -> None:
    diff = float((got - reference).abs().max())
    agree = float((got.argmax(-1) == reference.argmax(-1)).float().mean())
    print(
        f"logits {label}: {tuple(got.shape)}, max abs diff {diff:.3e} "
        f"(max |logit| {float(reference.abs().max()):.2f}), top-1 agreement {agree:.4f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="quantkit checkpoint directory")
    parser.add_argument("--export", type=Path, default=None, help="an existing GPTQ export of it (default: export)")
    parser.add_argument("--loader", choices=("gptqmodel", "transformers"), default="gptqmodel")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    with tempfile.TemporaryDirectory() as tmp:
        export = args.export
        if export is None:
            export = Path(tmp) / "gptq"
            export.mkdir()
            summary = write_gptq(open_export_source(args.checkpoint), export)
            print(f"exported: {summary.tensor_types}, {summary.bytes:,} bytes")
        theirs = load_gptq(export, args.loader, dtype).eval()
        print(f"{args.loader} loaded {sum(hasattr(m, 'qweight') for m in theirs.modules())} GPTQ linears")
        exact, total, worst = compare_weights(args.checkpoint, theirs)
        print(f"weights: {exact}/{total} linears bit-exact, max abs diff {worst:.3e}")
        ids = input_ids(args.checkpoint)
        reference = logits(load_quantized_model(args.checkpoint, dtype=torch.float32).eval(), ids)
        stack = logits(theirs, ids)
        same_dtype = logits(load_quantized_model(args.checkpoint, dtype=dtype).eval(), ids)
        report(f"{args.loader} {args.dtype} vs quantkit float32", stack, reference)
        report(f"quantkit {args.dtype} vs quantkit float32", same_dtype, reference)
        report(f"{args.loader} {args.dtype} vs quantkit {args.dtype}", stack, same_dtype)
    return 0 if exact == total else 1


if __name__ == "__main__":
    sys.exit(main())
