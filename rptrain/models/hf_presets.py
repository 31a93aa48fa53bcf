"""Published model shapes as config.json dicts, and the config.json of a Llama preset.

MoE presets (MOE_PRESETS: qwen3_30b_a3b, gpt_oss_20b) are random-init models of the published shapes,
for benchmarks; they build through `qwen3_config` like the Qwen3 ones and export as their architecture.

The Qwen3 presets are random-init models with the shapes Qwen published (Qwen3-0.6B/1.7B/8B config.json:
q/k RMSNorm, head_dim 128 independent of hidden_size, tied embeddings for the two small ones); they build
through the same decoder as `model=hf` and export as Qwen3ForCausalLM. A Llama preset (LlamaConfig)
exports as LlamaForCausalLM with `llama_hf_config`.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from rptrain.models.decoder import Device, build_decoder
from rptrain.models.decoder_config import DecoderConfig
from rptrain.models.families import FAMILIES
from rptrain.models.hf_config import decoder_config
from rptrain.models.llama_config import LlamaConfig
from rptrain.models.registry import register_model

_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, hidden_act="silu",
              rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=40960, attention_bias=False,
              use_sliding_window=False, sliding_window=None, initializer_range=0.02)  # token ids: the run's tokenizer's

QWEN3_PRESETS: dict[str, dict] = {
    "qwen3_0_6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3_1_7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3_8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=False),
}


# Mixtures of experts, for benchmarks: Qwen3-30B-A3B's and GPT-OSS-20B's published config.json shapes
# (GPT-OSS's bf16 layout: its published weights are MXFP4, which model=hf refuses).
_GPT_OSS_LAYERS = 24
MOE_PRESETS: dict[str, dict] = {
    "qwen3_30b_a3b": dict(_QWEN3, model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], router_aux_loss_coef=0.001, output_router_logits=False, tie_word_embeddings=False,
                          max_window_layers=48),
    "gpt_oss_20b": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
                        intermediate_size=2880, num_hidden_layers=_GPT_OSS_LAYERS, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=64, num_experts=32, num_experts_per_tok=4, sliding_window=128,
                        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(_GPT_OSS_LAYERS)],
                        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                          original_max_position_embeddings=4096),
                        rope_theta=150000.0, max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0,
                        attention_bias=True, tie_word_embeddings=False, router_aux_loss_coef=0.9, output_router_logits=False,
                        hidden_act="silu", initializer_range=0.02),
}
PRESETS: dict[str, dict] = {**QWEN3_PRESETS, **MOE_PRESETS}  # every preset written as a config.json (less its architectures)


def _architectures(model_type: str) -> list[str]:
    """config.json's architectures: the class its family record names (families.py)."""
    return [FAMILIES[model_type].architecture]


def preset_json(name: str, **fields) -> dict:
    """A preset's config.json with some fields replaced (None keeps the published value, e.g. vocab_size).
    A GPT-OSS preset with another num_hidden_layers gets its alternating layer_types to match."""
    raw = {**PRESETS[name], **{k: v for k, v in fields.items() if v is not None}}
    raw["architectures"] = _architectures(raw["model_type"])
    if raw["model_type"] == "gpt_oss" and fields.get("num_hidden_layers") is not None:
        raw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(raw["num_hidden_layers"])]
    return raw


def qwen3_config(name: str, max_seq_len: int | None = None, init_std: float = 0.02, loss_chunk_tokens: int = 4096,
                 fused: bool = False, **fields) -> DecoderConfig:
    """A preset (Qwen3 or MoE) with some config.json fields replaced (None keeps the published value)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
    cfg = decoder_config(preset_json(name, **fields), f"model={name}", max_seq_len, loss_chunk_tokens, fused=fused)
    return dataclasses.replace(cfg, init_std=init_std)


def build_qwen3(name: str, device: Device = None, dtype: torch.dtype | None = None, **overrides) -> nn.Sequential:
    return build_decoder(qwen3_config(name, **overrides), device, dtype)


for _name in PRESETS:
    register_model(_name)(functools.partial(build_qwen3, _name))


def llama_hf_config(cfg: LlamaConfig) -> dict:
    """The LlamaForCausalLM config.json of a Llama preset (rope_theta/rope_scaling spelt as transformers 4 and 5 both read them)."""
    scaling = None
    if cfg.rope_scaling is not None:
        factor, low, high, original = cfg.rope_scaling
        scaling = dict(rope_type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                       original_max_position_embeddings=original)
    return dict(
        architectures=_architectures("llama"), model_type="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_hidden, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, rope_scaling=scaling, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
    )
