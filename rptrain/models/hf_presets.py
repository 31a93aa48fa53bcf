"""Published model shapes as config.json dicts, and the config.json of a Llama preset.

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
from rptrain.models.hf_config import decoder_config
from rptrain.models.llama_config import LlamaConfig
from rptrain.models.registry import register_model

_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, head_dim=128, hidden_act="silu",
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


def qwen3_config(name: str, max_seq_len: int | None = None, init_std: float = 0.02, loss_chunk_tokens: int = 4096,
                 fused: bool = False, **fields) -> DecoderConfig:
    """A Qwen3 preset with some config.json fields replaced (None keeps the published value, e.g. vocab_size)."""
    if name not in QWEN3_PRESETS:
        raise ValueError(f"unknown qwen3 preset {name!r}; allowed: {', '.join(QWEN3_PRESETS)}")
    raw = {**QWEN3_PRESETS[name], **{k: v for k, v in fields.items() if v is not None}}
    cfg = decoder_config(raw, f"model={name}", max_seq_len, loss_chunk_tokens, fused=fused)
    return dataclasses.replace(cfg, init_std=init_std)


def build_qwen3(name: str, device: Device = None, dtype: torch.dtype | None = None, **overrides) -> nn.Sequential:
    return build_decoder(qwen3_config(name, **overrides), device, dtype)


for _name in QWEN3_PRESETS:
    register_model(_name)(functools.partial(build_qwen3, _name))


def llama_hf_config(cfg: LlamaConfig) -> dict:
    """The LlamaForCausalLM config.json of a Llama preset (rope_theta/rope_scaling spelt as transformers 4 and 5 both read them)."""
    scaling = None
    if cfg.rope_scaling is not None:
        factor, low, high, original = cfg.rope_scaling
        scaling = dict(rope_type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                       original_max_position_embeddings=original)
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_hidden, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, rope_scaling=scaling, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
    )
