"""The model card every checkpoint gets: a Hub metadata block that parses (base_model when the Hub id is known,
library_name, tags with the preset and number format, the base model's license), the coverage summary, an
evaluation section a recipe fills; written with the checkpoint, leaving model.safetensors as it was."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from quantkit.format.coverage import FLOAT
from quantkit.format.files import MODEL_CARD, RUN_LOG
from quantkit.format.presets import PRESETS
from quantkit.format.scheme import QuantScheme
from quantkit.model.resolve import hub_id_of
from quantkit.quantization import checkpoint_output
from quantkit.quantization.assignment import SchemeAssignment
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.coverage_intent import linear_intents
from quantkit.quantization.methods.records import LayerRecord
from quantkit.quantization.model_card import (
    EVAL_END,
    EVAL_START,
    NOT_EVALUATED,
    format_tag,
    front_matter,
    preset_of,
    with_evaluation,
)
from quantkit.quantization.pipeline import quantize_model


def _rtn(scheme: QuantScheme | None = None, **fields) -> QuantizeConfig:
    return QuantizeConfig.for_method("rtn", scheme=scheme, show_progress=False, **fields)


def _hub_snapshot(model: Path, root: Path, repo: str = "org--tiny-llama") -> Path:
    """``model`` copied where the Hub's cache keeps a download: models--org--name/snapshots/<revision>/."""
    snapshot = root / f"models--{repo}" / "snapshots" / "0123abc"
    shutil.copytree(model, snapshot)
    return snapshot


def test_a_card_with_the_hub_metadata_block(tiny_model_dir, tmp_path) -> None:
    source = _hub_snapshot(tiny_model_dir, tmp_path / "hub")
    (source / MODEL_CARD).write_text("---\nlicense: apache-2.0\nlanguage: [en]\ntags: [float]\n---\n# Tiny\n")
    out = tmp_path / "w4"
    quantize_model(str(source), _rtn(PRESETS["W4A16"]), out)

    card = (out / MODEL_CARD).read_text()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta == front_matter(card)
    assert meta["base_model"] == "org/tiny-llama" and meta["base_model_relation"] == "quantized"
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["tags"] == ["quantkit", "compressed-tensors", "w4a16", "int4"]
    assert meta["license"] == "apache-2.0" and meta["language"] == ["en"]  # the base model's terms, not its tags
    assert card.count("\n# ") == 1 and "# tiny-llama, W4A16 (rtn)" in card  # the card is ours, not the source's
    assert "| dense MLP | 6 |" in card and "| all | 21 |" in card  # the coverage summary
    assert "w4-g128-sym" in card and "layout g128 -> g64" in card  # the tiny shapes fall back, said in the card
    assert f"{EVAL_START}\n{NOT_EVALUATED}\n{EVAL_END}" in card
    assert "## Use" in card and "AutoModelForCausalLM.from_pretrained" in card and "vllm serve" in card
    assert str(tmp_path) not in card and "0123abc" not in card  # no path of this machine


def test_a_local_model_without_a_hub_id_gets_no_base_model(tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "w8"
    ignore = [r"layers\.0\.self_attn\.o_proj"]
    quantize_model(str(tiny_model_dir), _rtn(QuantScheme(bits=8, group_size=32), ignore=ignore), out)
    card = (out / MODEL_CARD).read_text()
    meta = front_matter(card)
    assert "base_model" not in meta and "license" not in meta
    assert meta["tags"] == ["quantkit", "compressed-tensors", "int8"]  # g32 is no preset
    assert f"The local model `{tiny_model_dir.name}`" in card and "w8-g32-sym" in card
    assert "kept in float by --ignore" in card
    assert "none (data-free)" in card


def test_the_card_and_log_leave_the_shards_as_they_were(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """The card is a new file and the log gains a key: the tensors are written byte for byte as without them."""
    described = tmp_path / "described"
    quantize_model(str(tiny_model_dir), _rtn(QuantScheme(group_size=32)), described)
    monkeypatch.setattr(checkpoint_output, "describe_checkpoint", lambda job, work, staged: None)
    bare = tmp_path / "bare"
    quantize_model(str(tiny_model_dir), _rtn(QuantScheme(group_size=32)), bare)
    assert (described / "model.safetensors").read_bytes() == (bare / "model.safetensors").read_bytes()
    assert (described / "config.json").read_bytes() == (bare / "config.json").read_bytes()
    assert {p.name for p in described.iterdir()} - {p.name for p in bare.iterdir()} == {MODEL_CARD, RUN_LOG}
    monkeypatch.undo()
    again = tmp_path / "again"
    quantize_model(str(tiny_model_dir), _rtn(QuantScheme(group_size=32)), again)
    assert (again / MODEL_CARD).read_bytes() == (described / MODEL_CARD).read_bytes()  # no time, no path
    assert (again / RUN_LOG).read_bytes() == (described / RUN_LOG).read_bytes()


def test_the_evaluation_section_is_replaced_or_appended() -> None:
    card = f"# x\n\n## Evaluation\n\n{EVAL_START}\n{NOT_EVALUATED}\n{EVAL_END}\n\n## After\n"
    once = with_evaluation(card, ["| metric | value |", "perplexity 12.3"])
    assert (
        once == f"# x\n\n## Evaluation\n\n{EVAL_START}\n| metric | value |\nperplexity 12.3\n{EVAL_END}\n\n## After\n"
    )
    assert with_evaluation(once, ["perplexity 12.3"]) == with_evaluation(card, ["perplexity 12.3"])  # idempotent
    edited = with_evaluation("# x\n", ["ppl 3"])
    assert edited == f"# x\n\n## Evaluation\n\n{EVAL_START}\nppl 3\n{EVAL_END}\n"


@pytest.mark.parametrize(
    ("scheme", "preset", "tag"),
    [
        (QuantScheme(bits=4, group_size=128, act_order=True, static_groups=True, mse_clip=True), "W4A16", "int4"),
        (PRESETS["INT8"], "W8A8", "int8"),  # the two names of one layout: the first
        (PRESETS["FP8_DYNAMIC"], "FP8_DYNAMIC", "fp8"),
        (PRESETS["NVFP4"], "NVFP4", "nvfp4"),
        (PRESETS["MXFP4A16"], "MXFP4A16", "mxfp4"),
        (QuantScheme(bits=4, group_size=64), None, "int4"),
    ],
)
def test_presets_and_tags_of_schemes(scheme: QuantScheme, preset: str | None, tag: str) -> None:
    assert preset_of(scheme) == preset and format_tag(scheme) == tag


def test_hub_ids_of_models(tmp_path: Path) -> None:
    local = tmp_path / "plain"
    local.mkdir()
    assert hub_id_of("smollm2-135m", local) == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the alias's original
    assert hub_id_of("Qwen/Qwen3-0.6B", local) == "Qwen/Qwen3-0.6B"
    assert hub_id_of(str(local), local) is None
    snapshot = tmp_path / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    assert hub_id_of(str(snapshot), snapshot) == "Qwen/Qwen3-0.6B"


def test_intents_of_a_run() -> None:
    g128, g64 = QuantScheme(group_size=128), QuantScheme(group_size=64)
    assignment = SchemeAssignment(
        {"a.q_proj": g64, "a.k_proj": None, "a.down_proj": g128},
        fallbacks={"a.q_proj": "g128 -> g64"},
        asked={"a.q_proj": g128},
    )
    records = [LayerRecord("a.down_proj", g128.name, None, None, fell_back_to_rtn=True)]
    intents = linear_intents(assignment, records, planned=False)
    assert intents["a.q_proj"].scheme == "w4-g128-sym" and intents["a.q_proj"].layout == "g128 -> g64"
    assert (intents["a.k_proj"].scheme, intents["a.k_proj"].float_by) == (FLOAT, "ignore")
    assert intents["a.down_proj"].rtn_fallback and not intents["a.q_proj"].rtn_fallback
    assert linear_intents(assignment, records, planned=True)["a.k_proj"].float_by == "plan"
