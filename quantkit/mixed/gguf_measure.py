"""The measurement behind ``--target-bpw``: each decoder linear's error on every candidate GGML type, on the
Hessian of its inputs in the float model (the compressed-tensors pipeline's block walk, nothing written back)."""

from __future__ import annotations

from typing import Any

import torch

from quantkit.data.calibration import CalibrationSet
from quantkit.mixed.gguf_budget import UnitTypes, measure
from quantkit.model.architectures import ArchSpec
from quantkit.model.blocks import BlockRunner, get_module
from quantkit.model.source_weights import SourceWeights, build_skeleton
from quantkit.model.staged_block import StagedBlock
from quantkit.quantization.block_loop import embed_inputs, stage_hessians, walk_blocks


def measure_units(
    units: list[UnitTypes], arch: ArchSpec, weights: SourceWeights, calibration: CalibrationSet | None, job: Any
) -> None:
    """Fill every unit's ``errors`` (one per candidate type), block by block."""
    by_name = {u.hf_name: u for u in units}
    skeleton = build_skeleton(weights.path)
    hidden = runner = None
    if calibration is not None:
        hidden = embed_inputs(skeleton, arch, weights, calibration.input_ids, torch.float32)
        runner = BlockRunner.for_model(skeleton, arch, calibration.seq_len, job.batch_size)
    visits = walk_blocks(skeleton, arch, weights, description="Measuring GGML types", show_progress=job.show_progress)
    for visit in visits:
        if runner is None or hidden is None:
            for name in arch.linears:
                unit = by_name[f"{visit.prefix}.{name}.weight"]
                unit.errors = measure(get_module(visit.module, name).weight.data, None, unit.types)
            continue
        staged = StagedBlock(visit.module, arch, runner, hidden)
        with torch.inference_mode():
            for stage, hessian, _ in stage_hessians(staged):
                for name in stage.linears:
                    unit = by_name[f"{visit.prefix}.{name}.weight"]
                    unit.errors = measure(get_module(visit.module, name).weight.data, hessian, unit.types)
                del hessian
            hidden = staged.output()
