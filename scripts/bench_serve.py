"""Serving benchmark, engine vs Hugging Face ``generate`` in static batches: now ``quantkit bench MODEL
--compare-hf`` (the workload, the driver and the HF baseline live in ``quantkit/bench/``). This script keeps its old
flags and forwards to that command.

    python scripts/bench_serve.py                      # SmolLM2-135M, 32 requests, HF batches of 8
    python scripts/bench_serve.py --model ./my-w4-ckpt --num-requests 16 --skip-hf
"""

from __future__ import annotations

import argparse
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="alias, HF directory or quantized checkpoint")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="only run the engine")
    args, rest = parser.parse_known_args()  # anything else goes to `quantkit bench` as is

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from quantkit.cli import main as quantkit_main

    sys.argv = [
        "quantkit",
        "bench",
        args.model,
        "--requests",
        str(args.num_requests),
        "--hf-batch-size",
        str(args.hf_batch_size),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--seed",
        str(args.seed),
        *([] if args.skip_hf else ["--compare-hf"]),
        *rest,
    ]
    quantkit_main()


if __name__ == "__main__":
    main()
