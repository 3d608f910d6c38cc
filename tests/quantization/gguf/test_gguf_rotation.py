"""`quantkit quantize --format gguf:<MIX> --rotate hadamard` on a tiny Llama with a tied head and norms that are not
ones (so that folding them matters): the head is untied in the plan and the file, each solved tensor is the solver's
answer for the rotated float weight (the rotation module's own fold, computed here independently of the run), the
norms are ones, the metadata is a plain Llama's, and transformers' GGUF loader gives the float model's logits within
the tolerance a plain (unrotated) file of the same type meets. What stays refused says so in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from export.test_gguf import bpe_tokenizer
from helpers.cli import run_cli
from helpers.tiny import perturb_norms, tiny_llama

from quantization.gguf.test_gguf_output import _quantize, decoded
from quantkit.format.gguf_file import tensor_nbytes
from quantkit.model.blocks import get_module
from quantkit.model.resolve import arch_for_dir
from quantkit.model.source_weights import SourceWeights, build_skeleton, load_module
from quantkit.quantization.gguf import driver
from quantkit.quantization.gguf.mixes import mix_of
from quantkit.quantization.gguf.plan import EMBEDDING, HEAD, plan_gguf
from quantkit.quantization.methods.rotation import RotationConfig, job_rotation
from quantkit.quantization.solvers.ggml_solve import ggml_rtn

# Largest |logit difference| to the float model that a plain (unrotated) Q8_0 file meets on this model (measured
# 0.019; rotated 0.018 with RTN): a rotation folded wrongly (a norm left out, a head unrotated) is far above it.
Q8_0_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hidden 256, intermediate 512, 2 layers, 4 heads over 2 KV heads, a tied head, norms 1 + 0.3 N(0, 1)."""
    path = tmp_path_factory.mktemp("rot") / "model"
    model = tiny_llama(
        bos_token_id=1, eos_token_id=2, vocab_size=300, hidden_size=256, intermediate_size=512, tie_word_embeddings=True
    )
    perturb_norms(model)
    model.save_pretrained(path)
    bpe_tokenizer().save_pretrained(path)
    return path


def rotated_weights(model_dir: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the rotated float model (float32), folded here with the rotation module's functions."""
    arch = arch_for_dir(model_dir)
    with SourceWeights(model_dir) as weights:
        rotation = job_rotation(RotationConfig(kind="hadamard", seed=seed), model_dir, arch, weights)
        out = rotation.outer_tensors(weights, dtype=torch.float32)
        skeleton = build_skeleton(model_dir)
        for i in range(len(get_module(skeleton, arch.layers_path))):
            prefix = f"{arch.layers_path}.{i}"
            block = get_module(skeleton, prefix)
            load_module(block, prefix, weights, dtype=torch.float32)
            rotation.fold(block)
            out |= {f"{prefix}.{name}": p.detach().clone() for name, p in block.named_parameters()}
    return out


def _spied(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[torch.Tensor, Any]]:
    """HF name (without .weight) -> (the weight the solver was handed, what it returned), for every solve."""
    seen: dict[str, tuple[torch.Tensor, Any]] = {}
    real = driver.solve_tensor

    def spy(weight: torch.Tensor, hessian: Any, type_name: str, settings: Any, name: str = "") -> Any:
        solved = real(weight, hessian, type_name, settings, name)
        seen[name.removesuffix(".weight")] = (weight.detach().float().clone(), solved)
        return solved

    monkeypatch.setattr(driver, "solve_tensor", spy)
    return seen


def _plan(model_dir: Path, mix: str, untie: bool) -> list:
    with SourceWeights(model_dir) as weights:
        return plan_gguf(weights, arch_for_dir(model_dir), mix_of(mix), untie_head=untie)


def test_untying_plans_an_output_tensor_with_llama_cpp_s_types(model_dir: Path) -> None:
    tied, untied = _plan(model_dir, "Q4_K_M", False), _plan(model_dir, "Q4_K_M", True)
    assert [t.name for t in untied] == [t.name for t in tied] + ["output.weight"]
    types = {t.name: t.type for t in tied}
    untied_types = {t.name: t.type for t in untied}
    # tied: token_embd is the output (Q6_K); untied: token_embd takes the base type, output.weight Q6_K
    assert types["token_embd.weight"] == "Q6_K" and "output.weight" not in types
    assert untied_types["token_embd.weight"] == "Q4_K" and untied_types["output.weight"] == "Q6_K"
    head = untied[-1]
    assert head.role == HEAD and head.hf_name == "lm_head.weight" and head.shape == (300, 256)
    cost = sum(tensor_nbytes(t.type, t.shape) for t in untied) - sum(tensor_nbytes(t.type, t.shape) for t in tied)
    # output.weight takes token_embd's old type (Q6_K) and token_embd the base type: the cost is one Q4_K matrix
    assert cost == tensor_nbytes("Q4_K", (300, 256)) == 43200
    assert {t.name: t.type for t in _plan(model_dir, "Q8_0", True)}["token_embd.weight"] == "Q8_0"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_rotated_file_holds_the_solver_s_answers_for_the_rotated_weights(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    seen = _spied(monkeypatch)
    out = tmp_path / "rot.gguf"
    report = _quantize(model_dir, out, "--format", "gguf:Q4_K_M", "--method", method, "--rotate", "hadamard")
    assert report["rotation"] == "hadamard-s0"
    expected = rotated_weights(model_dir)
    got = decoded(out)
    plan = {t.name: t for t in _plan(model_dir, "Q4_K_M", True)}
    assert {n: t for n, (t, _) in got.items()} == {n: t.type for n, t in plan.items()}
    for name, t in plan.items():
        values = torch.from_numpy(np.array(got[name][1]))
        if t.type == "F32":
            assert torch.equal(values, expected[t.hf_name]), name
            if name.endswith("norm.weight"):
                assert torch.equal(values, torch.ones_like(values)), name  # folded away
            continue
        handed, solved = seen[t.hf_name.removesuffix(".weight")]
        assert torch.equal(handed, expected[t.hf_name]), name  # the solver got the rotated float weight
        assert torch.equal(values, solved.dequantized), name  # and the file holds its answer
        if method == "rtn" or t.role == EMBEDDING:  # the embedding has no Hessian: round-to-nearest in either case
            assert torch.equal(values, ggml_rtn(expected[t.hf_name], t.type).dequantized), name
    if method == "gptq":
        q = "blk.0.attn_q.weight"
        rtn = ggml_rtn(expected[plan[q].hf_name], plan[q].type).dequantized
        assert not torch.equal(torch.from_numpy(np.array(got[q][1])), rtn)  # GPTQ moved codes off the nearest


def _kv(path: Path) -> dict[str, Any]:
    return {f.name: f.contents() for f in gguf.GGUFReader(path).fields.values() if not f.name.startswith("GGUF.")}


def _logit_error(model_dir: Path, path: Path) -> float:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return float((loaded(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max())


@pytest.mark.slow
def test_transformers_reads_rotated_files_as_the_float_model_within_a_plain_file_s_tolerance(
    model_dir: Path, tmp_path: Path
) -> None:
    files = {}
    for name, extra in {
        "plain": ["--method", "rtn"],
        "rtn": ["--method", "rtn", "--rotate", "hadamard"],
        "gptq": ["--rotate", "hadamard", "--rotate-seed", "3"],
    }.items():
        files[name] = tmp_path / f"{name}.gguf"
        _quantize(model_dir, files[name], "--format", "gguf:Q8_0", *extra)
    errors = {name: _logit_error(model_dir, path) for name, path in files.items()}
    assert all(error < Q8_0_TOLERANCE for error in errors.values()), errors
    # a plain Llama file: the same metadata, one more tensor (the untied head)
    assert _kv(files["rtn"]) == _kv(files["plain"]) and _kv(files["gptq"]) == _kv(files["plain"])
    names = {t.name for t in gguf.GGUFReader(files["gptq"]).tensors}
    assert names == {t.name for t in gguf.GGUFReader(files["plain"]).tensors} | {"output.weight"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--format", "gguf:auto", "--target-bpw", "6"], "--rotate does not apply to --format gguf:auto"),
        (["--format", "gguf:Q4_K_M", "--method", "rtn", "--float-targets"], "float targets work only with gptq"),
        (["--format", "gguf:Q4_K_M", "--method", "awq+gptq"], "rtn or gptq alone; got AWQConfig"),
    ],
)
def test_what_stays_refused_stops_in_one_line(model_dir: Path, tmp_path: Path, capsys, extra, message) -> None:
    out = tmp_path / "x.gguf"
    code, _, stderr = run_cli(["quantize", str(model_dir), "-o", str(out), "--rotate", "hadamard", *extra], capsys)
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert list(tmp_path.iterdir()) == []


def test_two_processes_are_refused_in_one_line(model_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    from quantkit.distributed import context

    monkeypatch.setattr(context, "_CURRENT", context.DistContext(rank=0, world=2))
    args = ["quantize", str(model_dir), "-o", str(tmp_path / "x.gguf"), "--format", "gguf:Q4_K_M"]
    code, _, stderr = run_cli([*args, "--rotate", "hadamard"], capsys)
    assert code == 2 and "--format gguf:Q4_K_M cannot run on 2 processes" in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_recipe_with_a_rotation_folds_it_into_its_gguf(model_dir, text_corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""\
model: {model_dir}
calibration: {{dataset: {text_corpus}, num_samples: 4, seq_len: 32}}
quantization: {{solvers: [rotation, rtn], scheme: {{bits: 8, group_size: 32}}}}
output: {{directory: {tmp_path / "ckpt"}, force: true, gguf: [q8_0]}}
evaluation: {{dataset: {text_corpus}, seq_len: 32, windows: 2}}
gates: {{max_ppl_increase_pct: 1000}}
""")
    code, _, err = run_cli(["run", str(recipe), "--report", str(tmp_path / "report")], capsys)
    assert code == 0, err
    got = decoded(tmp_path / "ckpt.Q8_0.gguf")
    assert got["output.weight"][0] == "Q8_0" and np.all(got["blk.1.ffn_norm.weight"][1] == 1.0)
    expected = rotated_weights(model_dir)
    assert torch.equal(
        torch.from_numpy(np.array(got["token_embd.weight"][1])),
        ggml_rtn(expected["model.embed_tokens.weight"], "Q8_0").dequantized,
    )
