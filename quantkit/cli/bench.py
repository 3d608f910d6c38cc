"""``quantkit bench MODEL``: a seeded serving benchmark of the bundled runtime, with a per-stage step profile.

``--json OUT`` writes one object (times in seconds unless the key says otherwise):

- ``model``; ``workload``: ``kind``, ``requests``, ``seed``, ``concurrency`` (null: all at once), ``prompt_tokens``
  and ``max_tokens`` (totals); ``engine``: the EngineConfig fields (every one is an option of the command)
- ``wall_s``, ``requests_per_s``, ``output_tokens``, ``output_tokens_per_s``, ``steps`` (engine steps that ran a
  batch), ``preemptions``
- ``ttft_s`` and ``tpot_s``: ``p50``, ``p95``, ``mean`` (from the engine's arrival / first-token / finish stamps)
- ``peak_rss_mb``: the process's peak RSS up to the end of the engine run (model load included; 1 MB = 1e6 bytes)
- ``kv_cache``: ``peak_usage`` (max fraction of KV blocks in use after a step), ``peak_tokens``,
  ``capacity_tokens``, ``num_blocks``, ``block_size``
- ``stages``: ``seconds``, ``share_of_wall``, ``ms_per_step`` (each by stage: schedule, propose, prepare, forward,
  sample, postprocess; the engine's StepProfile over the measured run) and ``total_s``
- ``speculation`` (null when off): ``drafted``, ``accepted``, ``verify_steps``, ``emitted``, ``acceptance_rate``,
  ``tokens_per_step`` (tokens per target forward pass of a sequence with drafts)
- ``copied_fraction``: share of output tokens inside 4-token runs that occur in their own prompt
- ``hf`` (null without ``--compare-hf``): ``batch_size``, ``wall_s``, ``output_tokens``, ``output_tokens_per_s``,
  ``requests_per_s``, ``ttft_s``, ``tpot_s``, ``engine_over_hf`` (ratio of output tokens/s), ``identical`` and
  ``compared`` (requests whose greedy tokens match)
- ``profile_trace``: the Chrome trace written by ``--profile`` (null without)
- ``per_request``: ``kind``, ``prompt_tokens``, ``output_tokens``, ``ttft_s``, ``tpot_s``, ``latency_s``,
  ``finish_reason``, in workload order
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from quantkit.cli.app import JsonOption, app, out, write_json_option
from quantkit.cli.engine_options import engine_options
from quantkit.runtime.config import EngineConfig

if TYPE_CHECKING:
    from quantkit.bench.hf_baseline import HFRun
    from quantkit.bench.workload import BenchRequest
    from quantkit.runtime.engine import Engine


@app.command()
@engine_options(help={"seed": "Seeds the workload (same seed, same requests) and the engine's sampling."})
def bench(
    model: Annotated[str, typer.Argument(help="Quantized checkpoint, HF model directory, hub id or alias.")],
    config: EngineConfig,
    requests: Annotated[int, typer.Option(help="Requests in the workload.")] = 32,
    concurrency: Annotated[
        int | None, typer.Option(help="Requests in flight at most; a new one starts as one finishes (default: all).")
    ] = None,
    workload: Annotated[
        str, typer.Option(help="free (continue a passage), copy (quote a passage, copy-heavy) or mixed.")
    ] = "free",
    compare_hf: Annotated[
        bool, typer.Option(help="Also run the requests through HF generate in static batches; compare.")
    ] = False,
    hf_batch_size: Annotated[int, typer.Option(help="--compare-hf: requests per HF generate batch.")] = 8,
    profile: Annotated[
        Path | None, typer.Option(help="Write a Chrome trace of the run (torch.profiler; open in Perfetto).")
    ] = None,
    json_out: JsonOption = None,
) -> None:
    """Benchmark the serving runtime on a seeded workload: throughput, TTFT/TPOT, memory, a per-stage profile."""
    import torch

    from quantkit.bench.report import build_report, render
    from quantkit.bench.run import run_engine, warm_up
    from quantkit.bench.workload import KINDS, make_workload
    from quantkit.errors import QuantkitError
    from quantkit.memory import keep_freed_memory_for_reuse
    from quantkit.runtime.engine import Engine

    if workload not in KINDS:
        raise QuantkitError(f"--workload {workload} is invalid; use one of {', '.join(KINDS)}")
    for name, value in (("requests", requests), ("concurrency", concurrency), ("hf-batch-size", hf_batch_size)):
        if value is not None and value < 1:
            raise QuantkitError(f"--{name} {value} is invalid; use an integer >= 1")
    keep_freed_memory_for_reuse()  # the decode loop reuses the same temporaries (quantkit/memory.py)
    engine = Engine(model, config)
    if engine.tokenizer is None:
        raise QuantkitError(f"{engine.path} has no tokenizer; the benchmark cuts its prompts from text")
    reqs = make_workload(engine.tokenizer, requests, workload, config.seed, engine.max_model_len)
    lens, maxes = [len(r.prompt) for r in reqs], [r.max_tokens for r in reqs]
    out.print(
        f"{len(reqs)} {workload} requests, prompts {min(lens)}-{max(lens)} tokens, max_tokens {min(maxes)}-"
        f"{max(maxes)}; {engine.device}, torch threads {torch.get_num_threads()}"
    )
    warm_up(engine)
    if profile is not None:
        from quantkit.bench.trace import chrome_trace

        with chrome_trace(engine, profile):
            run = run_engine(engine, reqs, concurrency, label_steps=True)
    else:
        run = run_engine(engine, reqs, concurrency)
    eos = frozenset(engine.scheduler.eos_token_ids)
    hf = _run_hf(engine, reqs, hf_batch_size, eos) if compare_hf else None
    info = {"kind": workload, "requests": requests, "seed": config.seed, "concurrency": concurrency}
    report = build_report(model, info, config, reqs, run, hf, eos, profile)
    render(report, out)
    write_json_option(json_out, report)


def _run_hf(engine: Engine, reqs: list[BenchRequest], batch_size: int, eos: frozenset[int]) -> HFRun:
    from quantkit.bench.hf_baseline import load_hf_model, run_hf, warm_up_hf

    hf_model = load_hf_model(engine)
    pad = engine.tokenizer.pad_token_id
    pad = pad if pad is not None else min(eos, default=0)
    warm_up_hf(hf_model, set(eos), pad, engine.model.config.vocab_size)
    return run_hf(hf_model, reqs, batch_size, set(eos), pad)
