import json
from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli

from quantkit.data.calibration import CalibrationConfig, build_calibration
from quantkit.errors import QuantkitError
from quantkit.eval.evaluate import EvalConfig, evaluate
from quantkit.format.scheme import QuantScheme
from quantkit.format.tensors import read_linear
from quantkit.model.architectures import arch_for_model_type
from quantkit.model.blocks import BlockRunner, embed
from quantkit.quantization import block_loop, pipeline
from quantkit.quantization.block_work import BlockRun
from quantkit.quantization.checkpoint_output import block_tensors
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods.composition import JobSteps
from quantkit.quantization.methods.gptq import GPTQConfig
from quantkit.quantization.methods.hooks import SolveJob
from quantkit.quantization.pipeline import quantize_model
from quantkit.quantization.quantize_block import quantize_block

SCHEME = QuantScheme(bits=4, group_size=32)


@pytest.fixture(scope="module")
def calib_file(tiny_model_dir, tmp_path_factory) -> Path:
    from helpers.paths import REPO

    text = tmp_path_factory.mktemp("calib") / "text.txt"
    text.write_text((REPO / "calibration" / "austen_persuasion_eval.txt").read_text()[:30000])
    out = text.with_name("calib.safetensors")
    config = CalibrationConfig(dataset=str(text), num_samples=8, seq_len=32, show_progress=False)
    build_calibration(str(tiny_model_dir), config, output=out)
    return out


def _quantize(model, calib, output, method="gptq", on_block_done=None, **kw):
    kw.setdefault("scheme", SCHEME)
    config = QuantizeConfig.for_method(method, calibration_file=calib, show_progress=False, batch_size=3, **kw)
    return quantize_model(str(model), config, output, on_block_done=on_block_done)


def _first_block_setup(rows: int, dtype: torch.dtype, seed: int):
    """A tiny Llama, its block runner and the embedded input of its first block for ``rows`` random windows."""
    from helpers.tiny import tiny_llama

    model = tiny_llama()
    arch = arch_for_model_type("llama")
    ids = torch.randint(0, 256, (rows, 16), generator=torch.Generator().manual_seed(seed))
    runner = BlockRunner.for_model(model, arch, 16, batch_size=2)
    return model, arch, runner, embed(model, arch, ids, dtype)


def test_checkpoint_reproduces_the_solver_weights_exactly(tiny_model_dir):
    model, arch, runner, hidden = _first_block_setup(4, torch.bfloat16, seed=0)
    block = model.model.layers[0]
    schemes = {name: SCHEME for name in arch.linears}
    run = BlockRun(arch, JobSteps([GPTQConfig()]), storage=torch.bfloat16, runner=runner)
    done = quantize_block(block, "model.layers.0", hidden.clone(), schemes, run)
    out = done.output
    assert out.shape == hidden.shape and len(done.records) == 7 and all(r.loss > 0 for r in done.records)
    tensors = block_tensors(block, "model.layers.0", done.weights, torch.bfloat16)
    for name in arch.linears:
        restored = read_linear(tensors, f"model.layers.0.{name}", SCHEME).dequantize()
        assert torch.equal(restored, done.weights[name].dequantize(torch.float32))
    # no later step runs the attention linears once h2 is complete: their dense copies are freed; the MLP's
    # (no spill file here) still compute the output with the dequantized weights
    for name in arch.linears:
        held = block.get_submodule(name).weight.data
        assert (
            held.numel() == 0 if name.startswith("self_attn.") else torch.equal(held, done.weights[name].dequantize())
        )
    # The output the next block sees is the quantized block's output.
    for name in arch.linears:
        block.get_submodule(name).weight.data = done.weights[name].dequantize(torch.float32)
    assert torch.allclose(out.float(), runner.run(block, hidden).float(), atol=0.05)


def test_staged_block_works_in_place_and_matches_a_plain_forward():
    from quantkit.model.staged_block import StagedBlock

    model, arch, runner, hidden = _first_block_setup(5, torch.float32, seed=1)
    block = model.model.layers[0]
    linears = {name: block.get_submodule(name) for name in arch.linears}
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in ("self_attn.o_proj", "mlp.down_proj")}
    hooks = [linears[n].register_forward_pre_hook(lambda _m, a, n=n: seen[n].append(a[0])) for n in seen]
    expected = runner.run(block, hidden)
    for hook in hooks:
        hook.remove()
    buffer = hidden.clone()
    staged = StagedBlock(block, arch, runner, buffer)
    for stage in arch.stages:
        inputs = [x.clone() for x in staged.stage_inputs(stage.name)]  # a yielded batch may be reused
        assert sum(x.shape[0] for x in inputs) == 5
        name = {"o": "self_attn.o_proj", "down": "mlp.down_proj"}.get(stage.name)
        if name is not None:  # captured without running the linear, equal to what a plain forward feeds it
            assert torch.allclose(torch.cat(inputs), torch.cat(seen[name]), atol=1e-5)
    assert all(block.get_submodule(n) is linear for n, linear in linears.items())  # recorders swapped back
    out = staged.output()
    assert out.data_ptr() == buffer.data_ptr()  # no second activation buffer for the output
    assert torch.allclose(out, expected, atol=1e-5)
    assert staged._context is None  # o_proj inputs freed once the residual stream is complete


@pytest.mark.parametrize(
    ("overrides", "fast_mlp"),
    [({}, True), ({"mlp_bias": True}, True), ({"hidden_act": "gelu"}, False)],
    ids=["silu", "silu-bias", "gelu-module-path"],
)
def test_spilled_activations_give_a_bit_identical_output_and_the_file_is_reused(tmp_path, overrides, fast_mlp):
    from helpers.tiny import tiny_llama

    from quantkit.model.staged_block import StagedBlock
    from quantkit.quantization.spill import SpillFile

    model = tiny_llama(**overrides)
    arch = arch_for_model_type("llama")
    ids = torch.randint(0, 256, (5, 16), generator=torch.Generator().manual_seed(2))
    runner = BlockRunner.for_model(model, arch, 16, batch_size=2)
    hidden = embed(model, arch, ids, torch.bfloat16)
    block = model.model.layers[0]
    path = tmp_path / "down.spill"
    context_bytes = 5 * 16 * block.self_attn.o_proj.in_features * 2  # bfloat16 [b, 16, hidden], batches of 2
    down_bytes = 5 * 16 * block.mlp.down_proj.in_features * 4  # float32 [b, 16, intermediate]

    def run(spill: SpillFile | None, start: torch.Tensor) -> torch.Tensor:
        staged = StagedBlock(block, arch, runner, start.clone(), spill=spill)
        assert (staged._gate_up is not None) == fast_mlp
        for stage in arch.stages:
            for _ in staged.stage_inputs(stage.name):
                pass
            if spill is not None and stage.name == "o":  # the attention context went to disk, not to memory
                assert staged._context is None
                context = [shape.numel() * 2 for shape, dtype in spill.written if dtype == torch.bfloat16]
                assert sum(context) == context_bytes
        if spill is not None:
            assert path.stat().st_size == down_bytes  # overwritten in place: the file never grows past one stage
            assert [shape[0] for shape, _ in spill.written] == [2, 2, 1]
        return staged.output()

    first = run(None, hidden)
    second = run(None, first)
    with SpillFile(path) as spill:
        assert torch.equal(run(spill, hidden), first)
        assert torch.equal(run(spill, first), second)  # the second block overwrites the first one's inputs
        assert path.stat().st_size == down_bytes and spill.written == []
    assert not path.exists()


@pytest.mark.slow
def test_gptq_beats_rtn_and_the_checkpoint_loads(tiny_model_dir, calib_file, tmp_path):
    results = {}
    for method in ("rtn", "gptq"):
        out = tmp_path / method
        result = _quantize(tiny_model_dir, calib_file, out, method=method)
        assert result.blocks == 2 and len(result.records) == 14
        config = json.loads((out / "config.json").read_text())
        assert config["quantization_config"]["format"] == "pack-quantized"
        assert (out / "tokenizer.json").is_file() and (out / "quantkit_log.json").is_file()
        assert not (tmp_path / f"{method}.partial").exists()
        config = EvalConfig(
            dataset=str(calib_file.with_name("text.txt")),
            seq_len=32,
            max_windows=30,
            reference=str(tiny_model_dir),
            show_progress=False,
        )
        results[method] = evaluate(out, config)
    assert results["gptq"].kl_mean < 0.5 * results["rtn"].kl_mean


@pytest.mark.slow
def test_resume_after_interruption_gives_identical_bytes(tiny_model_dir, calib_file, tmp_path):
    whole = tmp_path / "whole"
    _quantize(tiny_model_dir, calib_file, whole)

    def stop_after_first(index):
        if index == 0:
            raise KeyboardInterrupt

    resumed = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        _quantize(tiny_model_dir, calib_file, resumed, on_block_done=stop_after_first)
    assert not resumed.exists() and (tmp_path / "resumed.partial" / "block_0000.safetensors").is_file()
    with pytest.raises(QuantkitError, match=r"cannot resume.*the method, scheme or solver options differ"):
        _quantize(tiny_model_dir, calib_file, resumed, scheme=QuantScheme(8, -1), resume=True)
    result = _quantize(tiny_model_dir, calib_file, resumed, resume=True)
    assert result.resumed_from == 1
    for name in ("model.safetensors", "config.json", "quantkit_log.json"):
        assert (whole / name).read_bytes() == (resumed / name).read_bytes(), name


def test_rtn_is_data_free_and_resumes(tiny_model_dir, tmp_path, monkeypatch):
    """Round-to-nearest draws no calibration data and keeps no activations, and still resumes exactly."""

    def no_calibration(*_args, **_kwargs):
        raise AssertionError("rtn must not build calibration data")

    monkeypatch.setattr(pipeline, "calibration_for_model", no_calibration)
    whole = tmp_path / "whole"
    _quantize(tiny_model_dir, None, whole, method="rtn")
    partial = tmp_path / "resumed.partial"

    def stop_after_first(index):
        assert not list(partial.glob("hidden*"))
        raise KeyboardInterrupt

    resumed = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        _quantize(tiny_model_dir, None, resumed, method="rtn", on_block_done=stop_after_first)
    result = _quantize(tiny_model_dir, None, resumed, method="rtn", resume=True)
    assert result.resumed_from == 1 and len(result.records) == 14
    assert (whole / "model.safetensors").read_bytes() == (resumed / "model.safetensors").read_bytes()
    log = json.loads((whole / "quantkit_log.json").read_text())
    assert log["calibration"] is None and log["fingerprints"]["calibration data"] == "none"


@pytest.mark.slow
def test_existing_output_is_protected(tiny_model_dir, calib_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(QuantkitError, match="exists; pass --force"):
        _quantize(tiny_model_dir, calib_file, out)
    assert (out / "keep.txt").read_text() == "precious"
    _quantize(tiny_model_dir, calib_file, out, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_calibration_from_another_tokenizer_is_refused(tmp_path, calib_file):
    from helpers.tiny import build_word_tokenizer, tiny_llama

    other = tmp_path / "other"
    tiny_llama().save_pretrained(other)
    build_word_tokenizer(vocab_size=100).save_pretrained(other)
    with pytest.raises(QuantkitError, match="made with another tokenizer"):
        _quantize(other, calib_file, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_only_one_block_is_in_memory_at_a_time(tiny_model_dir, calib_file, tmp_path, monkeypatch):
    live: set[int] = set()
    peak = [0]
    real_load, real_release = block_loop.load_module, block_loop.release_module

    def load(module, prefix, weights, dtype=torch.float32, device=None):
        real_load(module, prefix, weights, dtype, device)
        live.add(id(module))
        peak[0] = max(peak[0], len(live))

    def release(module):
        real_release(module)
        live.discard(id(module))
        assert all(p.is_meta for p in module.parameters())

    monkeypatch.setattr(block_loop, "load_module", load)
    monkeypatch.setattr(block_loop, "release_module", release)
    _quantize(tiny_model_dir, calib_file, tmp_path / "out", method="rtn")
    assert peak[0] == 1 and not live


def test_ignored_linears_stay_float(tiny_model_dir, calib_file, tmp_path):
    out = tmp_path / "out"
    _quantize(tiny_model_dir, calib_file, out, method="rtn", ignore=[r"layers\.1\.mlp\."])
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.mlp.down_proj" in config["ignore"] and "lm_head" in config["ignore"]
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.down_proj.weight" in keys and "model.layers.0.mlp.down_proj.weight_packed" in keys
    with pytest.raises(QuantkitError, match="must share one scheme"):
        _quantize(tiny_model_dir, calib_file, tmp_path / "x", ignore=["q_proj"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "magic"], "unknown method 'magic'"),
        (["--bits", "5"], "bits=5 is not supported"),
        (["--group-size", "0"], "group size 0 is invalid"),
        (["--ignore", "("], "not a valid regular expression"),
    ],
)
def test_quantize_cli_rejects_bad_input(tiny_model_dir, calib_file, tmp_path, capsys, args, message):
    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", str(tiny_model_dir), "-o", str(out), "--calib", str(calib_file), *args], capsys)
    assert code == 2 and message in " ".join(err.split())
    assert not out.exists()


def test_quantize_and_inspect_cli(tiny_model_dir, calib_file, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli(
        [
            "quantize",
            str(tiny_model_dir),
            "-o",
            str(out),
            "--calib",
            str(calib_file),
            "--method",
            "rtn",
            "--bits",
            "8",
            "--group-size",
            "-1",
        ],
        capsys,
    )
    assert code == 0, err
    report = tmp_path / "inspect.json"
    code, _, err = run_cli(["inspect", str(out), "--json", str(report)], capsys)
    assert code == 0, err
    data = json.loads(report.read_text())
    assert 8.0 < data["avg_bits_per_weight"] < 8.5


def test_stacked_solve_equals_solving_each_linear():
    from quantkit.quantization.methods import registry
    from quantkit.quantization.solvers.gptq import gptq_solve

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 48, generator=gen) @ torch.randn(48, 48, generator=gen)
    hessian = 2 * x.T @ x / x.shape[0]
    weights = [torch.randn(n, 48, generator=gen) for n in (32, 16, 16)]
    scheme = QuantScheme(bits=4, group_size=16, act_order=True)
    job = SolveJob("block", ["q", "k", "v"], weights, hessian, scheme, torch.bfloat16)
    stacked = registry.by_name("gptq").hooks.solve(GPTQConfig(), job)
    for w, (qw, record) in zip(weights, stacked, strict=True):
        alone = gptq_solve(w, hessian, scheme, GPTQConfig()).weight
        assert torch.allclose(qw.dequantize(), alone.dequantize(), atol=1e-6)
        assert torch.equal(qw.g_idx, alone.g_idx) and record.loss > 0


@pytest.mark.slow
@pytest.mark.parametrize(("method", "symmetric"), [("rtn", True), ("gptq", True), ("awq", False)])
def test_cli_default_symmetry_follows_the_method(tiny_model_dir, calib_file, tmp_path, capsys, method, symmetric):
    out = tmp_path / "out"
    args = ["quantize", str(tiny_model_dir), "-o", str(out), "--calib", str(calib_file), "--group-size", "32"]
    code, _, err = run_cli([*args, "--method", method], capsys)
    assert code == 0, err
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert groups["group_0"]["weights"]["symmetric"] is symmetric


@pytest.mark.slow
def test_cli_gptq_defaults_to_act_order_with_static_groups(tiny_model_dir, calib_file, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["quantize", str(tiny_model_dir), "-o", str(out), "--calib", str(calib_file), "--group-size", "32"]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    weights = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert weights["weights"]["actorder"] == "weight"  # static groups: no g_idx, loadable by other engines
    assert weights["weights"]["observer"] == "mse"  # Hessian-weighted MSE clipping is on for gptq
    plain_args = ["--no-act-order", "--no-mse-clip"]
    code, _, err = run_cli(
        [
            "quantize",
            str(tiny_model_dir),
            "-o",
            str(tmp_path / "plain"),
            "--calib",
            str(calib_file),
            "--group-size",
            "32",
            *plain_args,
        ],
        capsys,
    )
    assert code == 0, err
    plain = json.loads((tmp_path / "plain" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert "actorder" not in plain["group_0"]["weights"]  # left out when off, as llm-compressor writes it
    assert plain["group_0"]["weights"]["observer"] == "minmax"


def test_solver_defaults_per_method_and_plans_take_the_run_options():
    from quantkit.quantization.methods.composition import parse_method, with_solver_options

    def defaults(method: str) -> tuple[bool, ...]:
        d = JobSteps(parse_method(method)).scheme_defaults()
        return d["symmetric"], d["act_order"], d["static_groups"], d["mse_clip"]

    assert defaults("gptq") == (True, True, True, True)
    assert defaults("awq+gptq") == (False, True, True, False)
    assert defaults("awq") == (False, False, True, False)
    assert defaults("rtn") == (True, False, True, False)
    planned = QuantScheme(bits=8, group_size=-1)
    solved = with_solver_options(planned, QuantScheme(act_order=True, static_groups=True, mse_clip=True))
    assert (solved.bits, solved.group_size, solved.act_order, solved.mse_clip) == (8, -1, True, True)
    with pytest.raises(QuantkitError, match="static-groups"):  # a g_idx the plan's budget did not count
        with_solver_options(planned, QuantScheme(act_order=True, static_groups=False))
