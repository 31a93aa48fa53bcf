"""Llama presets: their hyper-parameters mapped onto the one decoder (rptrain.models.decoder),
and size/FLOP estimates.

Presets are randomly initialised; `load_weights` reads a local checkpoint.
"""

import torch
from torch import nn

from rptrain.models.decoder import Device, build_decoder
from rptrain.models.decoder_config import DecoderConfig
from rptrain.models.llama_config import LlamaConfig
from rptrain.models.registry import register_model
from rptrain.models.rope import Rope

_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=131072,
               rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_seq_len=8192)

LLAMA_PRESETS: dict[str, dict] = {
    # CPU tests: ffn_hidden comes out at 192.
    "llama_tiny": dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=256),
    # GPT-2-small-sized with a Llama-2-sized vocabulary (~128M parameters).
    "llama_125m": dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_hidden=3072,
                       tie_embeddings=True, max_seq_len=2048),
    # Llama 3.2 1B / 3B and Llama 3.1 8B: shapes and rotary scaling as published.
    "llama_1b": dict(_LLAMA3, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192, tie_embeddings=True,
                     rope_scale_factor=32.0),
    "llama_3b": dict(_LLAMA3, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_hidden=8192, tie_embeddings=True,
                     rope_scale_factor=32.0),
    "llama_8b": dict(_LLAMA3, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, tie_embeddings=False,
                     rope_scale_factor=8.0),
}


def llama_config(name: str, **overrides) -> LlamaConfig:
    """A preset's config with some fields replaced (e.g. vocab_size=259)."""
    if name not in LLAMA_PRESETS:
        raise ValueError(f"unknown llama preset {name!r}; allowed: {', '.join(LLAMA_PRESETS)}")
    # Build from the raw fields so derived ones (ffn_hidden) follow overrides of dim.
    return LlamaConfig(**{**LLAMA_PRESETS[name], **overrides})


def decoder_config(cfg: LlamaConfig) -> DecoderConfig:
    scaled = cfg.rope_scale_factor != 1
    rope = Rope(theta=cfg.rope_theta, type="llama3" if scaled else "default", factor=cfg.rope_scale_factor,
                low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_seq_len)
    return DecoderConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                         n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.ffn_hidden,
                         norm_eps=cfg.norm_eps, rope=rope, tie_embeddings=cfg.tie_embeddings, max_seq_len=cfg.max_seq_len,
                         init_std=cfg.init_std, loss_chunk_tokens=cfg.loss_chunk_tokens, fused=cfg.fused)


def build_llama(cfg: LlamaConfig, device: Device = None, dtype: torch.dtype | None = None) -> nn.Sequential:
    """device="meta" allocates nothing, so even llama_8b can be built anywhere."""
    return build_decoder(decoder_config(cfg), device, dtype)


def _register(name: str) -> None:
    @register_model(name)
    def build(device: Device = None, dtype: torch.dtype | None = None, **overrides) -> nn.Sequential:
        return build_llama(llama_config(name, **overrides), device, dtype)


for _name in LLAMA_PRESETS:
    _register(_name)


def _attention_params(cfg: DecoderConfig) -> int:
    D, q_out, kv_out = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return D * q_out + 2 * D * kv_out + q_out * D


def _mlp_params(cfg: DecoderConfig, layer: int, active: bool) -> int:
    """One layer's MLP matmul weights: dense, or a MoE's router plus every expert (active: the top_k a token uses)."""
    D = cfg.hidden_size
    if not cfg.routes(layer):
        return 3 * D * cfg.intermediate_size
    moe = cfg.moe
    return D * moe.n_experts + (moe.top_k if active else moe.n_experts) * 3 * D * moe.expert_size


def _norm_params(cfg: DecoderConfig) -> int:
    return 2 * cfg.hidden_size + 2 * cfg.head_dim * cfg.qk_norm


def _decoder(cfg: LlamaConfig | DecoderConfig) -> DecoderConfig:
    return decoder_config(cfg) if isinstance(cfg, LlamaConfig) else cfg


def parameter_count(cfg: LlamaConfig | DecoderConfig) -> int:
    """Distinct parameters (a tied embedding/head matrix counts once; biases, sinks and sandwich norms left out)."""
    cfg = _decoder(cfg)
    table = cfg.vocab_size * cfg.hidden_size
    embeddings = table if cfg.tie_embeddings else 2 * table
    layers = sum(_attention_params(cfg) + _mlp_params(cfg, i, active=False) + _norm_params(cfg) for i in range(cfg.n_layers))
    return embeddings + layers + cfg.hidden_size


def flops_per_token(cfg: LlamaConfig | DecoderConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), the usual estimate (Kaplan et al., PaLM, nanoGPT):

        6 * N  +  12 * n_layers * n_heads * head_dim * seq_len

    N counts the weights that take part in a matmul: every projection plus the LM
    head (the embedding lookup costs no FLOPs and norms are negligible), so tied
    and untied models cost the same; a MoE layer counts its router and the top_k experts a token
    runs (the active parameters). Each weight costs 2 FLOPs per token forward
    and 4 backward. The second term is QK^T and attention@V (2 * 2 * T * d_attn
    forward per layer, x3 with backward), counted over the full T x T square as
    PaLM does, i.e. without halving for the causal mask.
    """
    cfg = _decoder(cfg)
    n = sum(_attention_params(cfg) + _mlp_params(cfg, i, active=True) for i in range(cfg.n_layers)) + cfg.vocab_size * cfg.hidden_size
    return 6 * n + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
