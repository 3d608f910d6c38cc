"""`quantkit quantize --format gguf:<MIX>` end to end on a tiny Llama whose widths are multiples of 256 (so the K
types are written, not their fallbacks): every tensor reads back through gguf.GGUFReader with the mix's type and
decodes to the solver's weights, transformers' GGUF loader gives the same logits as quantkit's decoded model,
inspect/eval read the file, and bad inputs stop in one line with nothing written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from export.test_gguf import bpe_tokenizer, gguf_row_order
from helpers.cli import run_cli
from helpers.tiny import tiny_llama

from quantkit.model.resolve import arch_for_dir
from quantkit.model.source_weights import SourceWeights
from quantkit.quantization.gguf.mixes import mix_of
from quantkit.quantization.gguf.plan import plan_gguf
from quantkit.quantization.solvers.ggml_solve import ggml_rtn

pytestmark = pytest.mark.slow
CALIB = ["--num-samples", "8", "--seq-len", "32", "--allow-small-calibration"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hidden 256, intermediate 512, 2 layers, 4 heads over 2 KV heads, untied head, a 300-token BPE tokenizer."""
    path = tmp_path_factory.mktemp("k") / "model"
    model = tiny_llama(bos_token_id=1, eos_token_id=2, vocab_size=300, hidden_size=256, intermediate_size=512)
    model.save_pretrained(path)
    bpe_tokenizer().save_pretrained(path)
    return path


def _quantize(model_dir: Path, out: Path, *extra: str) -> dict:
    """``quantkit quantize`` through typer's CliRunner; the --json report."""
    from typer.testing import CliRunner

    from quantkit.cli.app import app

    report = out.with_suffix(".json")
    args = ["quantize", str(model_dir), "-o", str(out), *CALIB, "--json", str(report), *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def rtn_file(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rtn") / "model.gguf"
    _quantize(model_dir, out, "--format", "gguf:Q4_K_M", "--method", "rtn")
    return out


@pytest.fixture(scope="module")
def gptq_file(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("gptq") / "model.gguf"
    return out, _quantize(model_dir, out, "--format", "gguf:Q4_K_M")


def decoded(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (type, decoded float32 in PyTorch order, q/k rows back in Hugging Face order)."""
    reader = gguf.GGUFReader(path)
    heads = {"attn_q": 4, "attn_k": 2}
    out = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        kind = t.name.split(".")[-2]
        if kind in heads:  # the file holds row gguf_row_order[i] of the HF weight at row i
            hf = np.empty_like(values)
            hf[gguf_row_order(values.shape[0], heads[kind])] = values
            values = hf
        out[t.name] = (t.tensor_type.name, values)
    return out


def planned_types(model_dir: Path, mix: str = "Q4_K_M") -> dict[str, tuple[str, str]]:
    with SourceWeights(model_dir) as weights:
        return {t.name: (t.type, t.hf_name) for t in plan_gguf(weights, arch_for_dir(model_dir), mix_of(mix))}


def test_rtn_file_holds_the_mix_s_types_and_decodes_to_the_solver_s_weights(model_dir: Path, rtn_file: Path) -> None:
    got = decoded(rtn_file)
    plan = planned_types(model_dir)
    assert {n: t for n, (t, _) in got.items()} == {n: t for n, (t, _) in plan.items()}
    assert {t for t, _ in plan.values()} == {"Q4_K", "Q6_K", "F32"}
    with SourceWeights(model_dir) as weights:
        for name, (qtype, hf_name) in plan.items():
            source = weights.get(hf_name).float()
            values = torch.from_numpy(np.array(got[name][1]))
            if qtype == "F32":
                assert torch.equal(values, source), name
            else:
                assert torch.equal(values, ggml_rtn(source, qtype).dequantized), name


def test_gptq_file_types_records_and_a_lower_output_error_than_rtn(model_dir: Path, gptq_file, rtn_file: Path) -> None:
    path, report = gptq_file
    got, rtn = decoded(path), decoded(rtn_file)
    assert {n: t for n, (t, _) in got.items()} == {n: t for n, (t, _) in planned_types(model_dir).items()}
    records = {r["name"]: r for r in report["tensors"]}
    assert records["blk.1.ffn_down.weight"]["type"] == "Q6_K" and records["blk.0.ffn_down.weight"]["type"] == "Q4_K"
    assert records["blk.0.attn_q.weight"]["loss"] > 0 and report["method"] == "gptq"
    assert report["file"]["file_bytes"] == path.stat().st_size
    assert not np.array_equal(got["blk.0.attn_q.weight"][1], rtn["blk.0.attn_q.weight"][1])


def test_transformers_gguf_loader_gives_quantkit_s_logits(model_dir: Path, gptq_file) -> None:
    from transformers import AutoModelForCausalLM

    path, _ = gptq_file
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    plan = planned_types(model_dir)
    state = ours.state_dict()
    for name, (_, values) in decoded(path).items():
        state[plan[name][1]] = torch.from_numpy(np.ascontiguousarray(values))
    ours.load_state_dict(state)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a, b = loaded(input_ids=ids).logits, ours(input_ids=ids).logits
    assert (a - b).abs().max() < 1e-4
    assert not torch.equal(
        ours.model.layers[0].self_attn.q_proj.weight,
        AutoModelForCausalLM.from_pretrained(model_dir).model.layers[0].self_attn.q_proj.weight,
    )


def test_inspect_and_eval_read_the_file(model_dir: Path, gptq_file, capsys, tmp_path: Path) -> None:
    path, _ = gptq_file
    code, stdout, _ = run_cli(["inspect", str(path), "--json", str(tmp_path / "i.json")], capsys)
    assert code == 0 and "Q6_K" in stdout and "Per type" in stdout
    info = json.loads((tmp_path / "i.json").read_text())
    types = {t["type"]: t for t in info["types"]}
    assert types["Q4_K"]["tensors"] == 13 and types["Q6_K"]["tensors"] == 3 and types["F32"]["tensors"] == 5
    assert abs(types["Q4_K"]["bpw"] - 4.5) < 1e-9 and info["file_bytes"] == path.stat().st_size
    args = ["eval", str(path), "--reference", str(model_dir), "--max-windows", "2", "--seq-len", "32"]
    code, stdout, stderr = run_cli([*args, "--json", str(tmp_path / "e.json")], capsys)
    assert code == 0, stdout + stderr
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["perplexity"] > 1 and result["kl_mean"] > 0 and 0 < result["top1_agreement"] <= 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--format", "gguf:Q4_K_X"], "unknown GGUF mix 'Q4_K_X'"),
        (["--format", "gguf:auto", "--target-bpw", "1.0"], "--target-bpw 1.0 is out of range"),
        (["--format", "gguf:auto", "--target-bpw", "12"], "out of range for this model"),
        (["--format", "gguf:Q4_K_M", "--target-bpw", "5"], "use --format gguf:auto"),
        (["--format", "gguf:Q4_K_M", "--bits", "4"], "--bits does not apply"),
        (["--format", "gguf:Q4_K_M", "--format", "gptq"], "give it alone"),
        (["--format", "gguf:Q4_K_M", "--resume"], "--resume does not apply"),
        (["--format", "gguf:Q4_K_M", "--method", "awq+gptq"], "rtn or gptq alone; got AWQConfig"),
    ],
)
def test_bad_inputs_stop_in_one_line_with_nothing_written(model_dir, tmp_path, capsys, extra, message) -> None:
    out = tmp_path / "x.gguf"
    code, _, stderr = run_cli(["quantize", str(model_dir), "-o", str(out), "--method", "rtn", *extra], capsys)
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert list(tmp_path.iterdir()) == []


def test_an_existing_output_needs_force(model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "x.gguf"
    out.write_bytes(b"old")
    code, _, stderr = run_cli(["quantize", str(model_dir), "-o", str(out), "--format", "gguf:Q6_K"], capsys)
    assert code != 0 and "pass --force" in stderr and out.read_bytes() == b"old"


def test_a_second_run_on_one_file_is_refused_and_a_killed_run_s_leftovers_go(model_dir, tmp_path, capsys) -> None:
    from quantization.test_output_lock import _holder

    out = tmp_path / "x.gguf"
    holder = _holder(out)  # another run writing this file
    try:
        code, _, stderr = run_cli(["quantize", str(model_dir), "-o", str(out), "--format", "gguf:Q6_K"], capsys)
    finally:
        holder.kill()
        holder.wait()
    assert code == 2 and f"being written by another quantkit run (pid {holder.pid}" in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1 and not out.exists()
    live = os.getppid()  # a live process's pid: the lock, not the pid, says these are a dead run's
    left = [tmp_path / f".x.gguf.work-{live}", tmp_path / f".x.gguf.tmp-{live}"]
    left[0].mkdir()
    left[1].write_bytes(b"half a file")
    code, _, stderr = run_cli(
        ["quantize", str(model_dir), "-o", str(out), "--format", "gguf:Q6_K", "--method", "rtn"], capsys
    )
    assert code == 0, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]  # the leftovers and the lock are gone
    assert gguf.GGUFReader(out).tensors


def test_an_architecture_without_gguf_stops_before_any_work(tmp_path, capsys) -> None:
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=300, pad_token_id=0)  # fmt: skip
    Phi3ForCausalLM(cfg).save_pretrained(tmp_path / "phi")
    bpe_tokenizer().save_pretrained(tmp_path / "phi")
    capsys.readouterr()  # the save's own progress output
    code, _, stderr = run_cli(
        ["quantize", str(tmp_path / "phi"), "-o", str(tmp_path / "p.gguf"), "--format", "gguf:Q4_K_M"], capsys
    )
    assert code != 0 and "phi3" in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "p.gguf").exists()


def test_target_bpw_file_stays_within_its_budget(model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "auto.gguf"
    report = _quantize(model_dir, out, "--format", "gguf:auto", "--target-bpw", "5.2", "--method", "rtn")
    tensor_bpw = report["file"]["tensor_bpw"]
    assert tensor_bpw <= 5.2 and abs(tensor_bpw - report["budget"]["bpw"]) < 1e-9
    types = {t["type"] for t in report["file"]["tensors"]}
    assert len(types - {"F32"}) >= 2  # a mix of types, not one


def test_a_recipe_writes_its_gguf_mixes_beside_the_checkpoint(model_dir, text_corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""\
model: {model_dir}
calibration: {{dataset: {text_corpus}, num_samples: 4, seq_len: 32}}
quantization: {{solvers: [gptq], scheme: {{bits: 4, group_size: 32}}}}
output: {{directory: {tmp_path / "ckpt"}, force: true, gguf: [q6_k]}}
evaluation: {{dataset: {text_corpus}, seq_len: 32, windows: 2}}
gates: {{max_ppl_increase_pct: 1000}}
""")
    code, _, err = run_cli(["run", str(recipe), "--report", str(tmp_path / "report")], capsys)
    assert code == 0, err
    path = tmp_path / "ckpt.Q6_K.gguf"
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types == {"Q6_K", "F32"}  # every 256-wide linear, the embedding and the head (Q6_K) as llama.cpp's Q6_K
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["figures"]["gguf Q6_K MB"] == round(path.stat().st_size / 1e6, 3)
