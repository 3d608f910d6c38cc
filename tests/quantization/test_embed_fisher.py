"""``--embedding-solver gptq``: the embedding solved by GPTQ under the Fisher of the first residual stream. The
block-at-a-time backward pass gives the Fisher a whole-model autograd pass gives; the solved table has a lower
Fisher-weighted error than round-to-nearest's in the run's rotated basis; a data-free run is refused."""

from __future__ import annotations

import pytest
import torch
from helpers.cli import cli_exit_code, run_cli
from helpers.tiny import save_tiny_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from quantkit.errors import QuantkitError
from quantkit.format.quant_embedding import dense_embedding
from quantkit.model.resolve import arch_for_dir
from quantkit.model.source_weights import SourceWeights
from quantkit.quantization.methods import embed_fisher
from quantkit.quantization.methods.embed_quant import EmbedQuantConfig
from quantkit.quantization.methods.head_quant import head_scheme
from quantkit.quantization.methods.rotation import RotationConfig, job_rotation

EMBED = "model.embed_tokens"


def _reference_fisher(path, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """The same Fisher from the whole model under autograd: labels drawn window by window from one generator."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    total = torch.zeros(model.config.hidden_size, model.config.hidden_size, dtype=torch.float64)
    for window in ids:
        x = model.get_input_embeddings()(window[None]).detach().requires_grad_(True)
        log_probs = torch.log_softmax(model(inputs_embeds=x, use_cache=False).logits[0].float(), -1)
        labels = torch.multinomial(log_probs.detach().exp(), 1, generator=generator)
        (grad,) = torch.autograd.grad(log_probs.gather(1, labels).sum(), x)
        total += grad[0].double().T @ grad[0].double()
    return total / ids.numel()


@pytest.mark.parametrize("tied", [True, False])
def test_the_block_at_a_time_fisher_equals_the_whole_model_autograd_one(tmp_path, monkeypatch, tied):
    path = save_tiny_model(tmp_path / "m", tie_word_embeddings=tied)
    ids = torch.randint(3, 250, (5, 16), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(embed_fisher, "CHUNK_WINDOWS", 2)  # chunks of 2, 2 and 1 windows
    fisher = embed_fisher.residual_fisher(
        path, arch_for_dir(path), SourceWeights(path), ids, torch.float32, seed=3, show_progress=False
    )
    reference = _reference_fisher(path, ids, seed=3)
    assert fisher.dtype == torch.float64 and fisher.shape == reference.shape
    assert torch.allclose(fisher, reference, rtol=1e-4, atol=1e-6 * float(reference.abs().max()))
    assert float(torch.linalg.eigvalsh(fisher).min()) > -1e-9 * float(fisher.diagonal().max())  # a Gram matrix


@pytest.fixture(scope="module")
def rotated_pair(tmp_path_factory, tiny_calib_file):
    """A tied tiny model, rotated, its embedding W4 g32 by each solver."""
    root = tmp_path_factory.mktemp("embed_fisher")
    source = save_tiny_model(root / "tied", tie_word_embeddings=True)
    outputs = {}
    for solver in ("rtn", "gptq"):
        out = root / solver
        args = ["quantize", str(source), "-o", str(out), "--calib", str(tiny_calib_file), "--group-size", "32"]
        args += ["--rotate", "hadamard", "--quantize-embedding", "w4g32", "--embedding-solver", solver]
        assert cli_exit_code(args) == 0
        outputs[solver] = out
    return source, outputs


def test_gptq_lowers_the_fisher_weighted_error_of_the_rotated_table(rotated_pair, tiny_calib_file):
    source, outputs = rotated_pair
    arch, weights = arch_for_dir(source), SourceWeights(source)
    rotation = job_rotation(RotationConfig(), source, arch, weights)
    basis = rotation.matrices.residual.double()
    table = rotation.outer_tensors(weights)[rotation.embed_name].double()  # the float table the run quantized
    ids = load_file(str(tiny_calib_file))["input_ids"].long()
    fisher = basis.T @ embed_fisher.residual_fisher(source, arch, weights, ids, torch.float32, show_progress=False)
    fisher = fisher @ basis
    scheme = head_scheme("w4g32", "rtn")
    errors = {}
    for solver, out in outputs.items():
        stored = load_file(str(out / "model.safetensors"))
        assert f"{EMBED}.weight_packed" in stored and f"{EMBED}.weight_g_idx" not in stored  # the same layout
        delta = dense_embedding(stored, EMBED, scheme, torch.float32).double() - table
        errors[solver] = float(torch.einsum("vi,ij,vj->", delta, fisher, delta))
    assert errors["gptq"] < 0.9 * errors["rtn"], errors


def test_a_data_free_run_and_an_unknown_solver_are_refused(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "out"
    args = ["quantize", str(tiny_model_dir), "-o", str(out), "--method", "rtn", "--group-size", "32"]
    args += ["--rotate", "hadamard", "--quantize-embedding", "w4g32", "--embedding-solver", "gptq"]
    code, stdout, stderr = run_cli(args, capsys)
    assert code != 0 and "data-free" in stdout + stderr and "--embedding-solver rtn" in stdout + stderr
    assert not out.exists()
    with pytest.raises(QuantkitError, match="unknown embedding solver 'fisher'"):
        EmbedQuantConfig(scheme="w4g64", solver="fisher")
    with pytest.raises(QuantkitError, match="fisher_windows must be >= 1"):
        EmbedQuantConfig(scheme="w4g64", solver="gptq", fisher_windows=0)
