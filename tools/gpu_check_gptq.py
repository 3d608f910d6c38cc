"""GPTQ time per decoder block on a device, on a model with few layers of a large model's width, and the estimate
for the full depth: the library's ``quantize`` (what ``quantkit quantize --method gptq`` runs) with a timestamp
after every block.

Estimate for ``full_layers``: the setup (calibration windows, embeddings: done once) plus ``full_layers`` times the
median block after the first (the first carries one-time allocations) plus the checkpoint writing scaled by depth.
The partial result is rewritten after every block, so a run killed at its limit still reports what it measured.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from tools.gpu_check_common import write


def gptq(args: argparse.Namespace) -> None:
    import quantkit

    config = quantkit.QuantizeConfig.for_method(  # W4 g128 with GPTQ's defaults, as `quantize --method gptq`
        "gptq",
        calibration=quantkit.CalibrationConfig(num_samples=args.num_samples, seq_len=args.seq_len, show_progress=False),
        device=args.device,
        force=True,
        show_progress=False,
    )
    figures: dict = {"device": args.device, "scheme": config.resolved_scheme().name}
    figures["windows"] = f"{args.num_samples}x{args.seq_len}"
    done: list[float] = []
    start = time.perf_counter()

    def on_block_done(index: int) -> None:
        done.append(time.perf_counter() - start)
        blocks = [b - a for a, b in itertools.pairwise(done)]
        figures["blocks_done"] = len(done)
        figures["first_block_done_s"] = round(done[0], 1)  # setup + the first block
        if blocks:
            figures["s_per_block"] = round(statistics.median(blocks), 2)
        write(args.out, {"figures": figures, "block_done_s": done})

    result = quantkit.quantize(str(args.model), config, args.output, on_block_done=on_block_done)
    layers = len(done)
    per_block = figures.get("s_per_block", done[0] if done else 0.0)
    setup = done[0] - per_block
    writing = result.seconds - done[-1]
    figures |= {
        "layers": layers,
        "seconds": round(result.seconds, 1),
        "setup_s": round(setup, 1),
        "write_s": round(writing, 1),
        f"estimate_{args.full_layers}_layers_s": round(
            setup + args.full_layers * per_block + writing * args.full_layers / layers, 0
        ),
        "peak_gpu_mb": result.peak_device_mb,
        "peak_rss_mb": round(result.peak_rss_mb),
        "fell_back_to_rtn": sum(r.fell_back_to_rtn for r in result.records),
    }
    if torch.cuda.is_available():
        figures["gpu"] = torch.cuda.get_device_name()
    write(args.out, {"figures": figures, "block_done_s": done})
