"""What rptrain knows about each Hugging Face `model_type`, as data: one `Family` record per type.

A record says which config.json fields the family honours (beyond the ones every family reads,
`hf_fields.COMMON`), which values it refuses, transformers' defaults for absent fields, and the
switches of the one decoder (`DecoderConfig`) it builds. `hf_config.decoder_config` reads a record
and never tests a family's name; a new family is a record here plus whatever blocks it needs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

SLIDING = frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"})
GEMMA2 = frozenset({"attention_bias", "hidden_activation", "use_bidirectional_attention", "attn_logit_softcapping",
                    "final_logit_softcapping", "query_pre_attn_scalar", "sliding_window", "layer_types"})
# Qwen3-MoE / Mixtral: the router and its load-balancing loss.
NO_BIAS = {"attention_bias": (False, "this family has no attention biases in transformers: it must be false")}
CAUSAL = {"use_bidirectional_attention": (False, "rptrain trains causal decoders: it must be false")}
MOE = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits"})
NO_WINDOW = {"use_sliding_window": (False, "rptrain does not train this family with sliding windows: it must be false")}
NO_JITTER = {"router_jitter_noise": (0.0, "router jitter is not supported: set it to 0.0")}


@dataclass(frozen=True)
class MoeRecord:
    """An MoE family's router and experts, and how its checkpoint spells them (transformers' in-memory
    names are ours: `mlp.gate` or `mlp.router`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`)."""

    expert_size_field: str = "moe_intermediate_size"  # Mixtral, GPT-OSS: intermediate_size
    routing: str = "softmax_topk"  # DecoderConfig.MoeConfig.routing
    norm_topk: bool | str = False  # a constant, or the config field that says it (Qwen3-MoE: norm_topk_prob)
    sparse_step: bool = False  # decoder_sparse_step and mlp_only_layers choose the MoE layers (else: all)
    bias: bool = False
    activation: str = "silu"
    interleaved: bool = False
    router: str = "gate"  # the router's module name in the checkpoint and in ours
    block: str = "mlp"  # the checkpoint's name of the MoE block inside a layer (Mixtral: block_sparse_moe)
    # experts.{e}.<name>.weight for gate, up, down in the checkpoint; None: stored fused, as in memory (GPT-OSS)
    per_expert: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # the *ForCausalLM class an export names
    reads: frozenset[str] = frozenset()  # fields this family honours beyond hf_fields.COMMON
    must: Mapping[str, tuple[Any, str]] = field(default_factory=dict)  # field -> (the only value rptrain computes as transformers does, why)
    dropouts: tuple[str, ...] = ("attention_dropout",)  # must be 0
    activation_field: str = "hidden_act"
    activations: Mapping[str, str] = field(default_factory=lambda: {"silu": "silu"})  # config value -> DecoderConfig.activation
    defaults: Mapping[str, Any] = field(default_factory=dict)  # transformers' values for absent fields
    layers: str = "full"  # absent layer_types: full | sliding (every layer) | max_window (qwen2) | alternate | every_nth
    window_switch: str | None = None  # a bool field without which transformers drops sliding_window
    rope: str = "single"  # single | per_layer_type (Gemma-3: local and global rotary)
    partial_rotary: bool = False  # honours partial_rotary_factor < 1
    switches: Mapping[str, Any] = field(default_factory=dict)  # DecoderConfig fields fixed by the family
    gemma: bool = False  # embeddings times sqrt(hidden_size), norms scale by (1 + weight)
    gemma2: bool = False  # query_pre_attn_scalar and soft-capping fields apply
    moe: MoeRecord | None = None  # an MoE family (its config fields are in `reads`)
    harmless: frozenset[str] = frozenset()  # fields this family's checkpoints carry that transformers does not read
    mxfp4: bool = False  # MXFP4 expert weights (quantization_config quant_method mxfp4) are dequantized at load


def _families(*records: Family) -> dict[str, Family]:
    return {r.model_type: r for r in records}


FAMILIES: dict[str, Family] = _families(
    Family("llama", "LlamaForCausalLM", frozenset({"attention_bias", "mlp_bias", "max_sequence_length"})),  # max_sequence_length: LLaMA-1 files; unused
    Family("mistral", "MistralForCausalLM", frozenset({"sliding_window", "attention_bias"}), must=NO_BIAS,
           defaults={"sliding_window": 4096}, layers="sliding"),
    Family("qwen2", "Qwen2ForCausalLM", SLIDING, layers="max_window", window_switch="use_sliding_window", switches={"qkv_bias": True}),
    Family("qwen3", "Qwen3ForCausalLM", SLIDING | {"attention_bias"}, layers="max_window", window_switch="use_sliding_window",
           switches={"qk_norm": True}),
    Family("gemma", "GemmaForCausalLM", frozenset({"attention_bias", "hidden_activation", "use_bidirectional_attention"}),
           must=CAUSAL, activations={"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_tanh"},
           defaults={"hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True}, gemma=True),
    Family("gemma2", "Gemma2ForCausalLM", GEMMA2 | {"sliding_window_size"},  # sliding_window_size: an old duplicate transformers ignores
           must=CAUSAL, activation_field="hidden_activation",
           activations={"gelu_pytorch_tanh": "gelu_tanh"},
           defaults={"hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "sliding_window": 4096,
                     "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
           layers="alternate", gemma=True, gemma2=True, switches={"sandwich_norms": True}),
    Family("gemma3_text", "Gemma3ForCausalLM", GEMMA2 | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"},
           must=CAUSAL, activation_field="hidden_activation",
           activations={"gelu_pytorch_tanh": "gelu_tanh"},
           defaults={"hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "sliding_window": 4096},
           layers="every_nth", rope="per_layer_type", gemma=True, gemma2=True, switches={"sandwich_norms": True, "qk_norm": True}),
    Family("phi3", "Phi3ForCausalLM", frozenset({"sliding_window", "embd_pdrop", "resid_pdrop", "original_max_position_embeddings",
                                                 "partial_rotary_factor", "attention_bias"}),
           must=NO_BIAS, dropouts=("attention_dropout", "embd_pdrop", "resid_pdrop"),
           defaults={"rms_norm_eps": 1e-5}, layers="sliding", partial_rotary=True,
           switches={"fused_qkv": True, "fused_gate_up": True}),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", SLIDING | MOE | {"attention_bias", "norm_topk_prob", "moe_intermediate_size",
                                                                 "decoder_sparse_step", "mlp_only_layers"},
           must=NO_WINDOW, defaults={"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
           switches={"qk_norm": True}, moe=MoeRecord(norm_topk="norm_topk_prob", sparse_step=True)),
    Family("mixtral", "MixtralForCausalLM", MOE | {"sliding_window", "router_jitter_noise"}, must=NO_JITTER,
           defaults={"num_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6, "rms_norm_eps": 1e-5}, layers="sliding",
           moe=MoeRecord(expert_size_field="intermediate_size", norm_topk=True, block="block_sparse_moe",
                         per_expert=("w1", "w3", "w2"))),
    # Attention sinks, alternating sliding and full layers, YaRN; biased router and experts with a clamped SwiGLU.
    Family("gpt_oss", "GptOssForCausalLM", MOE | {"attention_bias", "sliding_window", "layer_types", "swiglu_alpha", "swiglu_limit"},
           defaults={"num_experts": 128, "num_experts_per_tok": 4, "head_dim": 64, "rms_norm_eps": 1e-5, "attention_bias": True,
                     "sliding_window": 128, "max_position_embeddings": 131072,
                     "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0}},
           layers="alternate", switches={"attn_sinks": True}, mxfp4=True,
           harmless=frozenset({"experts_per_token", "initial_context_length"}),  # duplicates in the published config.json
           moe=MoeRecord(expert_size_field="intermediate_size", routing="topk_softmax", bias=True, activation="clamped_swiglu",
                         interleaved=True, router="router", per_expert=None)),
)


def family(model_type: Any) -> Family | None:
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None
