"""Every shape and switch of the one decoder implementation (rptrain.models.decoder).

The Llama presets fill it from `LlamaConfig`; `model=hf` fills it from a checkpoint's config.json
(rptrain.models.hf_config). Each family is a combination of these switches, not a subclass.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rptrain.models.rope import Rope

ACTIVATIONS = ("silu", "gelu_tanh")
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")
ROUTINGS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts MLP of some layers (rptrain.models.moe): a router picks top_k of n_experts
    gated MLPs per token; their outputs are summed with the routing weights."""

    n_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate size
    layers: tuple[bool, ...]  # per layer: this MoE block (else the dense MLP of intermediate_size)
    routing: str = "softmax_topk"  # softmax_topk: softmax over all experts, then top k (Qwen3-MoE, Mixtral); topk_softmax: top k logits, softmax over them (GPT-OSS)
    norm_topk: bool = False  # softmax_topk: renormalise the k probabilities to sum to 1 (Mixtral always, Qwen3-MoE norm_topk_prob)
    router_name: str = "gate"  # the router's module name (transformers': gate, GPT-OSS: router)
    bias: bool = False  # biased router and experts (GPT-OSS)
    activation: str = "silu"  # silu: down(silu(gate) * up); clamped_swiglu: GPT-OSS's, with swiglu_alpha and swiglu_limit
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    interleaved: bool = False  # GPT-OSS: experts stored (in, out) with gate and up columns interleaved
    aux_coef: float = 0.001  # router_aux_loss_coef
    aux_in_loss: bool = False  # transformers' output_router_logits: add aux_coef * the load-balancing loss to the loss

    def __post_init__(self):
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be between 1 and the {self.n_experts} experts")
        if self.routing not in ROUTINGS or self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"routing {self.routing!r} / expert activation {self.activation!r} unknown")

    @property
    def n_layers(self) -> int:
        """How many layers route: the load-balancing loss averages over them."""
        return sum(self.layers)


@dataclass
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-5
    norm_offset: bool = False  # Gemma: RMSNorm scales by (1 + weight), computed in float32
    activation: str = "silu"  # of the gated MLP: silu (SwiGLU) | gelu_tanh (GeGLU)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma-3: RMSNorm over each head of q and k before rotary
    fused_qkv: bool = False  # Phi-3: one qkv_proj, one gate_up_proj
    fused_gate_up: bool = False
    sandwich_norms: bool = False  # Gemma-2/3: norms after attention and MLP too
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    attn_sinks: bool = False  # GPT-OSS: a learnt per-head logit that joins every softmax and then is dropped
    final_softcap: float | None = None
    rope: Rope = field(default_factory=Rope)
    local_rope: Rope | None = None  # the sliding-window layers' own rotary settings (Gemma-3)
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()  # per layer: attends within sliding_window; () = none
    moe: MoeConfig | None = None  # mixture-of-experts layers; None: every layer's MLP is dense
    tie_embeddings: bool = False
    padding_idx: int | None = None  # transformers' pad_token_id: that embedding row gets no gradient
    max_seq_len: int = 2048
    attention: str = "auto"  # auto | sdpa | flex: FlexAttention block masks on CUDA for packed rows and windows (auto: rptrain.models.attention.AUTO_FLEX_ON_CUDA)
    init_std: float = 0.02
    loss_chunk_tokens: int = 4096  # tokens per logits chunk in the fused LM-head loss
    # The elementwise work between the matmuls (RMSNorm, residual add + norm, q/k norm + rotary, the gated
    # activation, the loss's softmax gradient) as torch.compile'd kernels (rptrain.models.fused); the math
    # and the weights are the same either way. Off: plain eager PyTorch.
    fused: bool = False

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: use one of {', '.join(ACTIVATIONS)}")
        if self.sliding_layers and len(self.sliding_layers) != self.n_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for {self.n_layers} layers")
        if self.attention not in ("auto", "sdpa", "flex"):
            raise ValueError(f"attention {self.attention!r}: use auto, sdpa or flex")
        if self.moe is not None and len(self.moe.layers) != self.n_layers:
            raise ValueError(f"the MoE layer list has {len(self.moe.layers)} entries for {self.n_layers} layers")
        if self.loss_chunk_tokens < 1:
            raise ValueError("loss_chunk_tokens must be positive")

    def routes(self, layer: int) -> bool:
        return self.moe is not None and self.moe.layers[layer]

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else None

    def layer_rope(self, layer: int) -> Rope:
        return self.local_rope if self.local_rope is not None and self.window(layer) is not None else self.rope
