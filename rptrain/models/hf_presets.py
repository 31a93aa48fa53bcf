"""Published model shapes as config.json dicts, and the config.json of a Llama preset.

The Qwen3 presets are random-init models with the shapes Qwen published (Qwen3-0.6B/1.7B/8B config.json:
q/k RMSNorm, head_dim 128 independent of hidden_size, tied embeddings for the two small ones); they build
through the same decoder as `model=hf` and export as Qwen3ForCausalLM. A Llama preset (LlamaConfig)
exports as LlamaForCausalLM with `llama_hf_config`.
"""
from __future__ import annotations

from rptrain.models.llama_config import LlamaConfig

_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, head_dim=128, hidden_act="silu",
              rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=40960, attention_bias=False,
              use_sliding_window=False, sliding_window=None, initializer_range=0.02, bos_token_id=151643, eos_token_id=151645)

QWEN3_PRESETS: dict[str, dict] = {
    "qwen3_0_6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3_1_7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3_8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=False),
}


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
