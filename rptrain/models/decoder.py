"""The one decoder: every family (Llama, Mistral, Qwen2/3, Gemma 1/2/3, Phi-3, the presets) as an
nn.Sequential configured by a `DecoderConfig`.

    [TokenEmbedding, DecoderBlock x n_layers, LMHeadLoss]

Feed `(input_ids, targets)` or, for packed sequences, `(input_ids, targets, segment_ids)`; the
model returns the summed token cross entropy (logits when targets is None). Activations travel
between elements as the same tuple with the hidden states in place of the ids, so the last
layer can make the loss without a side channel. A model with mixture-of-experts layers carries
the router statistics third: `(hidden, targets, stats[, segment_ids])` (rptrain.models.moe). Parameter names follow `hf_names`: each layer's
modules carry transformers' names (self_attn.q_proj, mlp.gate_proj, input_layernorm, ...).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from rptrain.models.attention import causal_attention, positions, uses_flex
from rptrain.models.decoder_config import DecoderConfig
from rptrain.models.fused import add_rms_norm, gated, kernel, qk_rotary, rms_norm
from rptrain.models.llama_loss import IGNORE_INDEX, LinearCrossEntropy
from rptrain.models.moe import SparseMoe, record_balance
from rptrain.models.router import balance_loss
from rptrain.models.rope import rotary_cos_sin

Device = torch.device | str | None
Batch = tuple  # (hidden or ids, targets or None[, segment_ids])


def _linear(n_in: int, n_out: int, bias: bool, device: Device, dtype) -> nn.Linear:
    # skip_init: nn.Linear's own init would be overwritten by reset_parameters (or by loaded
    # weights), and at billions of parameters drawing every weight twice costs minutes.
    # skip_init needs a real device: None would leave the weights on "meta".
    return skip_init(nn.Linear, n_in, n_out, bias=bias, device=torch.get_default_device() if device is None else device, dtype=dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False, device: Device = None, dtype=None, fused: bool = False):
        super().__init__()
        self.eps, self.offset, self.fused = eps, offset, fused
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 0.0 if self.offset else 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel(rms_norm, self.fused)(x, self.weight, self.eps, self.offset)


class SelfAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int, device: Device = None, dtype=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rope, self.window = cfg.layer_rope(layer), cfg.window(layer)
        self.scale, self.softcap, self.flex = cfg.attn_scale, cfg.attn_softcap, uses_flex(cfg.attention)
        self.fused = cfg.fused
        q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.splits = (q_out, kv_out, kv_out)
        if cfg.fused_qkv:
            self.qkv_proj = _linear(cfg.hidden_size, q_out + 2 * kv_out, cfg.qkv_bias, device, dtype)
        else:
            self.q_proj = _linear(cfg.hidden_size, q_out, cfg.qkv_bias, device, dtype)
            self.k_proj = _linear(cfg.hidden_size, kv_out, cfg.qkv_bias, device, dtype)
            self.v_proj = _linear(cfg.hidden_size, kv_out, cfg.qkv_bias, device, dtype)
        self.o_proj = _linear(q_out, cfg.hidden_size, cfg.o_bias, device, dtype)
        if cfg.attn_sinks:
            self.sinks = nn.Parameter(torch.empty(cfg.n_heads, device=device, dtype=dtype))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_offset, device, dtype, cfg.fused)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_offset, device, dtype, cfg.fused)

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        pos = None if segments is None else positions(segments)
        cos, sin = rotary_cos_sin(self.rope, self.head_dim, pos, T, x.device, x.dtype)
        # q/k norms (Qwen3, Gemma-3), heads before time, rotary: one kernel per tensor when fused.
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.offset) if hasattr(self, "q_norm") else (None, None, 0.0, False)
        q, k = kernel(qk_rotary, self.fused)(q, k, cos, sin, *norms)
        sinks = getattr(self, "sinks", None)
        y = causal_attention(q, k, v, self.scale, self.softcap, self.window, segments, self.flex, sinks)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """Gated: down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: DecoderConfig, device: Device = None, dtype=None):
        super().__init__()
        D, F_ = cfg.hidden_size, cfg.intermediate_size
        self.activation, self.fused = cfg.activation, cfg.fused
        if cfg.fused_gate_up:
            self.gate_up_proj = _linear(D, 2 * F_, cfg.mlp_bias, device, dtype)  # gate rows first, then up
        else:
            self.gate_proj = _linear(D, F_, cfg.mlp_bias, device, dtype)
            self.up_proj = _linear(D, F_, cfg.mlp_bias, device, dtype)
        self.down_proj = _linear(F_, D, cfg.mlp_bias, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(kernel(gated, self.fused)(gate, up, self.activation))


class TokenEmbedding(nn.Module):
    """(input_ids, targets[, segment_ids]) -> (hidden, targets[, segment_ids]). Bare ids: no targets."""

    def __init__(self, cfg: DecoderConfig, device: Device = None, dtype=None):
        super().__init__()
        self.max_seq_len, self.init_std, self.scale, self.padding_idx = cfg.max_seq_len, cfg.init_std, cfg.embed_scale, cfg.padding_idx
        self.n_experts = 0 if cfg.moe is None else cfg.moe.n_experts
        self.embed_tokens = skip_init(nn.Embedding, cfg.vocab_size, cfg.hidden_size,
                                      device=torch.get_default_device() if device is None else device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embed_tokens.weight, std=self.init_std)

    def forward(self, batch: Batch | torch.Tensor) -> Batch:
        input_ids, *rest = (batch, None) if isinstance(batch, torch.Tensor) else batch
        if input_ids.size(-1) > self.max_seq_len:
            raise ValueError(f"sequence length {input_ids.size(-1)} exceeds max_seq_len {self.max_seq_len}")
        h = F.embedding(input_ids, self.embed_tokens.weight, self.padding_idx)
        if self.scale is not None:  # a float32 scalar rounded to the compute dtype, as transformers does
            h = h * torch.tensor(self.scale, dtype=torch.float32).to(h.dtype)
        if self.n_experts:  # the router statistics start at zero (rptrain.models.moe)
            targets, *segments = rest
            return (h, targets, torch.zeros(2, self.n_experts, device=h.device, dtype=torch.float32), *segments)
        return (h, *rest)


class DecoderBlock(nn.Module):
    """Pre-norm block: h + attn(norm(h)), then h + mlp(norm(h)); sandwich_norms also norms each output."""

    def __init__(self, cfg: DecoderConfig, layer: int, device: Device = None, dtype=None):
        super().__init__()
        self.init_std, self.fused = cfg.init_std, cfg.fused
        # Projections that write into the residual stream get a smaller init so the stream's
        # variance does not grow with depth (GPT-2).
        self.out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_offset, device, dtype, cfg.fused)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = SelfAttention(cfg, layer, device, dtype)
        self.post_attention_layernorm = norm()
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.moe = cfg.moe is not None  # the batch carries router statistics
        self.mlp = SparseMoe(cfg.moe, cfg.hidden_size, device, dtype) if cfg.routes(layer) else MLP(cfg, device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        outputs = []
        for name, p in self.named_parameters():
            if "norm" in name or name.endswith("bias"):
                nn.init.constant_(p, 0.0 if "norm" not in name or self.input_layernorm.offset else 1.0)
            elif name.startswith(("self_attn.o_proj", "mlp.down_proj", "mlp.experts.down_proj")):
                outputs.append(p)
            else:
                nn.init.normal_(p, std=self.init_std)
        for p in outputs:  # drawn last: the order (and so the seeded weights) of the first presets
            nn.init.normal_(p, std=self.out_std)

    def _mlp(self, x: torch.Tensor, stats: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.mlp(x, stats) if isinstance(self.mlp, SparseMoe) else (self.mlp(x), stats)

    def forward(self, batch: Batch) -> Batch:
        h, targets, *rest = batch
        stats = rest.pop(0) if self.moe else None
        segments = rest[0] if rest else None
        attn = self.self_attn(self.input_layernorm(h), segments)
        if hasattr(self, "pre_feedforward_layernorm"):
            h = h + self.post_attention_layernorm(attn)
            out, stats = self._mlp(self.pre_feedforward_layernorm(h), stats)
            h = h + self.post_feedforward_layernorm(out)
        else:  # the residual add and the norm after it: one kernel when fused
            norm = self.post_attention_layernorm
            h, normed = kernel(add_rms_norm, self.fused)(h, attn, norm.weight, norm.eps, norm.offset)
            out, stats = self._mlp(normed, stats)
            h = h + out
        return (h, targets, stats, *rest) if self.moe else (h, targets, *rest)


class LMHead(nn.Module):
    """Holds the output matrix as `lm_head.weight`: its own, or the embedding's Parameter when tied."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


class LMHeadLoss(nn.Module):
    """(hidden, targets[, segments]) -> summed token cross entropy (0-dim float32), or logits if targets is None.

    The sum, not the mean, so microbatches add up exactly; the trainer divides by the global
    `count_tokens`. Full logits never exist: the head, the (soft-capped) logits and the loss are
    fused and chunked (LinearCrossEntropy).
    """

    def __init__(self, cfg: DecoderConfig, tied_weight: nn.Parameter | None = None, device: Device = None, dtype=None):
        super().__init__()
        self.chunk_tokens, self.init_std, self.softcap, self.fused = cfg.loss_chunk_tokens, cfg.init_std, cfg.final_softcap, cfg.fused
        self.tied = tied_weight is not None
        self.moe = cfg.moe
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_offset, device, dtype, cfg.fused)
        weight = tied_weight if self.tied else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype))
        self.lm_head = LMHead(weight)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.norm.reset_parameters()
        if not self.tied:  # a tied weight belongs to the embedding, which initialises it
            nn.init.normal_(self.lm_head.weight, std=self.init_std)

    def forward(self, batch: Batch) -> torch.Tensor:
        h, targets, *rest = batch
        h, weight = self.norm(h), self.lm_head.weight
        if targets is None:
            logits = F.linear(h, weight).float()
            return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap
        # Function.forward cannot see the grad mode, so tell it whether to make grads.
        need_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
        loss = LinearCrossEntropy.apply(h.reshape(-1, h.size(-1)), weight, targets.reshape(-1),
                                        self.chunk_tokens, need_grad, self.softcap, self.fused)
        if self.moe is None or not self.moe.n_layers:
            return loss
        aux = balance_loss(rest[0], targets.numel(), self.moe.n_layers)
        record_balance(aux)
        if self.moe.aux_in_loss:
            # transformers adds coef * aux to the mean loss; this sum is divided by the batch's token count
            # later, so the term is scaled by this microbatch's tokens (one microbatch: exactly transformers';
            # several: transformers' per microbatch; docs/moe.md says why the whole batch's is out of reach).
            loss = loss + self.moe.aux_coef * aux * (targets != IGNORE_INDEX).sum()
        return loss


def build_decoder(cfg: DecoderConfig, device: Device = None, dtype: torch.dtype | None = None) -> nn.Sequential:
    """device="meta" allocates nothing, so even an 8B model can be built anywhere."""
    embedding = TokenEmbedding(cfg, device, dtype)
    blocks = [DecoderBlock(cfg, i, device, dtype) for i in range(cfg.n_layers)]
    head = LMHeadLoss(cfg, embedding.embed_tokens.weight if cfg.tie_embeddings else None, device, dtype)
    return nn.Sequential(embedding, *blocks, head)
