"""Presets that export: the Qwen3 configs mirror the published shapes (the parameter count of transformers'
Qwen3ForCausalLM on the same config.json), and a shrunken preset's export loads in transformers with our
logits (fp32, rel 1e-5): Qwen3 (q/k norms, explicit head_dim) and Llama with Llama-3 rotary scaling."""
from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module
from transformers import AutoConfig, AutoModelForCausalLM

from rptrain.models import QWEN3_PRESETS, build_model
from rptrain.models.hf_presets import preset_json
from rptrain.train import schema
from rptrain.train.errors import ConfigError
from rptrain.train.export import export_weights
from rptrain.train.model import build_model as build_run_model
from rptrain.train.validate import validate_config

SHAPES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
          "rms_norm_eps", "rope_theta", "tie_word_embeddings")


@pytest.fixture(scope="module")
def make():
    schema.register_configs()
    with initialize_config_module("rptrain.conf", version_base="1.3"):
        yield lambda *overrides: compose("config", overrides=list(overrides))


@pytest.mark.parametrize("name", sorted(QWEN3_PRESETS))
def test_qwen3_presets_have_the_published_shapes(make, name):
    preset, model_cfg = QWEN3_PRESETS[name], make(f"model={name}").model
    assert {k: model_cfg[k] for k in SHAPES} == {k: preset[k] for k in SHAPES}  # the YAML and the preset agree
    assert model_cfg.max_seq_len == preset["max_position_embeddings"]
    validate_config(make(f"model={name}", "data=synthetic_tokens"))
    with pytest.raises(ConfigError, match="model.hidden_sise is not a config key"):
        validate_config(make(f"model={name}", "data=synthetic_tokens", "+model.hidden_sise=8"))
    ours = sum(p.numel() for p in build_model(name, device="meta").parameters())
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**preset))
    assert [type(theirs).__name__] == preset_json(name)["architectures"] == ["Qwen3ForCausalLM"]  # the family record's
    assert ours == sum(p.numel() for p in theirs.parameters())


TINY = {
    "qwen3_8b": ["model.hidden_size=48", "model.intermediate_size=96", "model.num_hidden_layers=2", "model.num_attention_heads=4",
                 "model.num_key_value_heads=2", "model.head_dim=16", "model.max_seq_len=64"],
    "llama_1b": ["model.dim=48", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=96",
                 "model.max_seq_len=64", "model.rope_original_max_seq_len=16"],
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_shrunken_preset_exports_with_our_logits(make, tmp_path, name):
    cfg = make(f"model={name}", *TINY[name], "data=synthetic_tokens", "data.vocab_size=96", "precision=fp32")
    torch.manual_seed(0)
    ours = build_run_model(cfg, torch.float32, vocab_size=96).eval()
    out = export_weights(cfg, ours.state_dict(), tmp_path / "hf", torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(ref).__name__ == {"qwen3_8b": "Qwen3ForCausalLM", "llama_1b": "LlamaForCausalLM"}[name]
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))  # past 16: the scaled rotary band matters
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "gpt_oss_20b"])
def test_moe_presets_have_the_published_shapes(make, name):
    from rptrain.models.hf_presets import MOE_PRESETS

    preset = MOE_PRESETS[name]
    validate_config(make(f"model={name}", "data=synthetic_tokens"))
    ours = build_model(name, device="meta")
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**preset))
    assert [type(theirs).__name__] == preset_json(name)["architectures"]  # the family record's
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    expected = {"qwen3_30b_a3b": 30.5e9, "gpt_oss_20b": 20.9e9}[name]  # the published totals
    assert abs(sum(p.numel() for p in ours.parameters()) / expected - 1) < 0.02


def test_moe_parameter_and_flop_counts():
    """parameter_count counts every expert (exactly the built model for Qwen3-MoE, which has no biases);
    flops_per_token the router and the top_k experts a token runs: with every expert active, all matmul weights."""
    from rptrain.models import flops_per_token, parameter_count, qwen3_config

    cfg = qwen3_config("qwen3_30b_a3b")
    assert parameter_count(cfg) == sum(p.numel() for p in build_model("qwen3_30b_a3b", device="meta").parameters())
    everything = qwen3_config("qwen3_30b_a3b", num_experts_per_tok=128)
    D, L = everything.hidden_size, everything.n_layers
    matmul = parameter_count(everything) - everything.vocab_size * D - L * (2 * D + 2 * everything.head_dim) - D  # less embedding, norms
    assert flops_per_token(everything, 0) == 6 * matmul
    assert flops_per_token(cfg, 0) < flops_per_token(everything, 0) / 8  # 8 of 128 experts, plus attention and the head


MOE_TINY = ["model.hidden_size=32", "model.intermediate_size=48", "model.num_hidden_layers=3", "model.num_attention_heads=4",
            "model.num_key_value_heads=2", "model.head_dim=8", "model.num_experts=4", "model.num_experts_per_tok=2", "model.max_seq_len=64"]


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "gpt_oss_20b"])
def test_shrunken_moe_preset_exports_with_our_logits(make, tmp_path, name):
    extra = ["model.moe_intermediate_size=16"] if name.startswith("qwen3") else []
    cfg = make(f"model={name}", *MOE_TINY, *extra, "data=synthetic_tokens", "data.vocab_size=96", "data.seq_len=32", "precision=fp32")
    validate_config(cfg)
    torch.manual_seed(0)
    ours = build_run_model(cfg, torch.float32, vocab_size=96).eval()
    out = export_weights(cfg, ours.state_dict(), tmp_path / "hf", torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, rtol=1e-5, atol=1e-5)
