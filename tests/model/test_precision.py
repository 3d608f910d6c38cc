"""--compute-dtype: the staged passes' products in bfloat16 give float32 stage inputs close to float32's (the
inputs of a stage no product feeds are the same), the autocast never leaks to the caller between mini-batches, an
unknown precision is refused with the choices, and auto becomes bfloat16 only where the CPU multiplies it natively
(the run's fingerprint records the resolved precision)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers.tiny import tiny_llama
from safetensors.torch import load_file

from quantkit.errors import QuantkitError
from quantkit.model import precision
from quantkit.model.architectures import arch_for_model_type
from quantkit.model.blocks import BlockRunner
from quantkit.model.precision import COMPUTE_DTYPES, compute_dtype, cpu_has_bfloat16_instructions, resolve_compute_dtype
from quantkit.model.staged_block import StagedBlock
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.pipeline import quantize_model


def test_an_unknown_compute_dtype_is_refused_with_the_choices() -> None:
    assert compute_dtype("bfloat16") is torch.bfloat16 and list(COMPUTE_DTYPES) == ["float32", "bfloat16"]
    wanted = "unknown --compute-dtype 'float16'; use one of float32, bfloat16, auto"
    with pytest.raises(QuantkitError, match=wanted):
        compute_dtype("float16")
    with pytest.raises(QuantkitError, match=wanted):
        QuantizeConfig(compute_dtype="float16", calibration=None).validate()


def _staged_run(dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every stage's inputs (all mini-batches) and the block output of a tiny Llama block run in ``dtype``."""
    model = tiny_llama(seed=3)
    arch = arch_for_model_type("llama")
    runner = BlockRunner.for_model(model, arch, 16, batch_size=2, compute_dtype=dtype)
    hidden = torch.randn(5, 16, 64, generator=torch.Generator().manual_seed(1))
    staged = StagedBlock(copy.deepcopy(model.model.layers[0]), arch, runner, hidden)
    inputs = {}
    for stage in staged.stages:
        batches = []
        for x in staged.stage_inputs(stage.name):
            assert not torch.is_autocast_enabled("cpu")  # the products' precision stays inside the pass
            assert x.dtype == torch.float32
            batches.append(x.clone())  # down_proj's inputs live in a reused buffer
        inputs[stage.name] = torch.cat(batches)
    return inputs, staged.output()


def test_bfloat16_products_give_float32_inputs_close_to_float32s() -> None:
    exact, exact_output = _staged_run(torch.float32)
    low, low_output = _staged_run(torch.bfloat16)
    assert torch.equal(low["qkv"], exact["qkv"])  # a norm of the block input: no product
    for name in ("o", "gate_up", "down"):
        error = float((low[name] - exact[name]).norm() / exact[name].norm())
        assert 1e-5 < error < 2e-2, (name, error)  # bfloat16 ran (not float32), and stays close
    error = float((low_output - exact_output).norm() / exact_output.norm())
    assert 1e-6 < error < 1e-2
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [
        ("flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw\n", False),  # AVX-512 without its bfloat16 part
        ("flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n", True),
        ("flags\t\t: fpu avx2 amx_bf16 amx_tile amx_int8\n", True),
        ("Features\t: fp asimd sve bf16 i8mm\n", True),  # Arm's BF16 extension (Graviton 3, Neoverse V1)
        ("Features\t: fp asimd evtstrm aes crc32\n", False),
    ],
)
def test_the_cpu_flags_say_whether_bfloat16_is_native(tmp_path: Path, cpuinfo: str, native: bool) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\n" + cpuinfo)
    assert cpu_has_bfloat16_instructions(path) is native


def test_auto_is_bfloat16_only_where_native_and_an_emulated_bfloat16_warns(monkeypatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "native_bfloat16", lambda device: True)
    assert resolve_compute_dtype("auto", cpu) == "bfloat16" and resolve_compute_dtype("float32", cpu) == "float32"
    monkeypatch.setattr(precision, "native_bfloat16", lambda device: False)
    assert resolve_compute_dtype("auto", cpu) == "float32"
    with pytest.warns(UserWarning, match="emulated and many times slower than float32; use --compute-dtype auto"):
        assert resolve_compute_dtype("bfloat16", cpu) == "bfloat16"  # what the user asked for, with the cost said
    with pytest.raises(QuantkitError, match="unknown --compute-dtype 'fp8'"):
        resolve_compute_dtype("fp8", cpu)


@pytest.mark.parametrize("native", [True, False])
def test_an_auto_run_is_the_run_of_the_precision_it_resolves_to(
    tiny_model_dir, tiny_calib_file, tmp_path: Path, monkeypatch, native: bool
) -> None:
    monkeypatch.setattr(precision, "native_bfloat16", lambda device: native)
    logs = {}
    for name in ("auto", "bfloat16" if native else "float32"):
        config = QuantizeConfig.for_method(
            "gptq", calibration_file=tiny_calib_file, show_progress=False, batch_size=2, compute_dtype=name
        )
        quantize_model(str(tiny_model_dir), config, tmp_path / name)
        logs[name] = json.loads((tmp_path / name / "quantkit_log.json").read_text())
    resolved = "bfloat16" if native else "float32"
    assert logs["auto"]["fingerprints"] == logs[resolved]["fingerprints"]  # --resume sees the precision solved in
    auto_weights = load_file(next((tmp_path / "auto").glob("*.safetensors")))
    resolved_weights = load_file(next((tmp_path / resolved).glob("*.safetensors")))
    assert all(torch.equal(auto_weights[k], resolved_weights[k]) for k in resolved_weights)
