"""``--embedding-layout unpacked``: an int8 embedding stored as compressed-tensors' naive-quantized (the int8 codes
are ``embed_tokens.weight`` itself), the quantized embedding transformers 5.22 loads (it cannot load a packed one:
test_embed_quant.py); quantkit's loader and runtime read it with the same table as the packed layout's."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from helpers.cli import run_cli
from helpers.tiny import save_tiny_model
from safetensors.torch import load_file

from quantkit.errors import QuantkitError
from quantkit.format.loader import load_quantized_model
from quantkit.format.loads_in import LayerShape, loads_in
from quantkit.format.quant_embedding import dense_embedding
from quantkit.format.quantization_config import parse_quantization_config
from quantkit.format.scheme import QuantScheme
from quantkit.quantization.methods.embed_quant import EmbedQuantConfig
from quantkit.quantization.methods.head_quant import head_scheme

TOKENS = torch.tensor([[1, 5, 9, 17, 33, 65, 129, 200, 7, 3, 250, 11]])
EMBED = "model.embed_tokens"


@pytest.fixture(scope="module")
def rotated_checkpoints(tmp_path_factory, tiny_calib_file):
    """A tied tiny model quantized with the rotation (which unties the head), a W4 head and an int8 embedding, once
    per layout."""
    from helpers.cli import cli_exit_code

    root = tmp_path_factory.mktemp("embed_layout")
    tied = save_tiny_model(root / "tied", tie_word_embeddings=True)
    outputs = {}
    for layout in ("packed", "unpacked"):
        out = root / layout
        args = ["quantize", str(tied), "-o", str(out), "--calib", str(tiny_calib_file), "--group-size", "32"]
        args += ["--rotate", "hadamard", "--quantize-head", "w4g32", "--quantize-embedding", "int8"]
        assert cli_exit_code([*args, "--embedding-layout", layout]) == 0
        outputs[layout] = out
    return outputs


def test_the_unpacked_embedding_is_naive_quantized_int8_codes_named_weight(rotated_checkpoints):
    stored = load_file(str(rotated_checkpoints["unpacked"] / "model.safetensors"))
    assert stored[f"{EMBED}.weight"].dtype == torch.int8 and f"{EMBED}.weight_packed" not in stored
    qc = json.loads((rotated_checkpoints["unpacked"] / "config.json").read_text())["quantization_config"]
    formats = {tuple(g["targets"]): g["format"] for g in qc["config_groups"].values()}
    assert formats[(EMBED,)] == "naive-quantized" and formats[("lm_head",)] == "pack-quantized"
    assert qc["format"] == "mixed-precision"
    # the same codes and scales as the packed layout: only the storage differs
    packed = load_file(str(rotated_checkpoints["packed"] / "model.safetensors"))
    scheme = head_scheme("int8", "rtn")
    table = dense_embedding(stored, EMBED, replace(scheme, unpacked=True), torch.float32)
    assert torch.equal(table, dense_embedding(packed, EMBED, scheme, torch.float32))


def test_transformers_quantkit_and_the_runtime_load_it_with_the_same_logits(rotated_checkpoints):
    from helpers.runtime import engine_logits, small_engine
    from transformers import AutoModelForCausalLM

    out = rotated_checkpoints["unpacked"]
    ours = load_quantized_model(out)
    assert type(ours.model.embed_tokens) is torch.nn.Embedding
    with torch.no_grad():
        reference = ours(TOKENS).logits.float()
        theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)(TOKENS).logits.float()
        packed = load_quantized_model(rotated_checkpoints["packed"])(TOKENS).logits.float()
    scale = max(1.0, float(reference.abs().max()))
    assert float((theirs - reference).abs().max()) < 1e-5 * scale
    assert float((packed - reference).abs().max()) < 1e-5 * scale
    got = engine_logits(small_engine(out), TOKENS[0].tolist())
    assert float((got - reference[0]).abs().max()) < 1e-4 * scale


def test_inspect_says_which_engines_load_each_layout():
    linear = LayerShape("model.layers.0.mlp.down_proj", QuantScheme(bits=4, group_size=32), 64, 160)
    for unpacked, transformers_loads in ((True, True), (False, False)):
        scheme = QuantScheme(bits=8, group_size=-1, unpacked=unpacked)
        verdicts = {v.engine: v for v in loads_in([linear], embedding=LayerShape(EMBED, scheme, 256, 64))}
        assert verdicts["transformers"].loads is transformers_loads
        vllm = [v for name, v in verdicts.items() if name.startswith("vLLM")]
        assert vllm and all(v.loads is not transformers_loads for v in vllm)
        assert all(EMBED in v.layers for v in [verdicts["transformers"], *vllm])


def test_unpacked_is_for_int8_and_refused_otherwise_in_one_line(tmp_path, tiny_calib_file, capsys):
    with pytest.raises(QuantkitError, match="symmetric 8-bit INT"):
        QuantScheme(bits=4, group_size=64, unpacked=True)
    with pytest.raises(QuantkitError, match="unknown embedding layout 'zip'"):
        EmbedQuantConfig("int8", layout="zip")
    tied = save_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    out = tmp_path / "out"
    capsys.readouterr()
    args = ["quantize", str(tied), "-o", str(out), "--calib", str(tiny_calib_file), "--rotate", "hadamard"]
    code, _, err = run_cli([*args, "--quantize-embedding", "w4g32", "--embedding-layout", "unpacked"], capsys)
    assert code == 2 and not out.exists() and "Traceback" not in err
    assert "use --quantize-embedding int8" in err.strip().splitlines()[-1]


def test_a_naive_quantized_int_group_reads_as_unpacked_and_4_bit_codes_are_refused():
    def config(bits: int) -> dict:
        weights = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "channel"}
        group = {"targets": [EMBED], "weights": weights, "format": "naive-quantized"}
        return {"quant_method": "compressed-tensors", "format": "naive-quantized", "config_groups": {"g": group}}

    scheme = parse_quantization_config(config(8)).scheme_for(EMBED, ["Embedding"])
    assert scheme is not None and scheme.unpacked and scheme.bits == 8
    with pytest.raises(QuantkitError, match="naive-quantized"):
        parse_quantization_config(config(4))
