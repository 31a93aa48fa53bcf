"""The layers of the Llama-style decoder: embedding, norm, rotary, decoder block.

Activations travel between Sequential elements as a tuple `(hidden, targets)`:
`targets` (next-token ids, or None) is carried untouched so that the last
layer can turn the hidden states into a loss without any side channel.
"""

import math

import torch
import torch.nn.functional as F
from torch.nn.utils import skip_init
from torch import nn

from rptrain.models.llama_config import LlamaConfig

Device = torch.device | str | None
Batch = tuple[torch.Tensor, torch.Tensor | None]

# SDPA learnt enable_gqa in torch 2.5; pyproject allows 2.4.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: Device = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Mean of squares in float32: fp16 overflows and bf16 is too coarse for it.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.type_as(x)


# Rotary tables depend only on shapes, so they are cached per process rather than
# stored as module buffers, which the pipeline engine would upload with every stage.
_ROPE_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rotary_frequencies(head_dim: int, theta: float, scaling: tuple | None, device: torch.device) -> torch.Tensor:
    """Radians per position of each rotated pair, with Llama 3.1's long-context scaling if given."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    wavelen = 2 * math.pi / inv_freq
    blend = (original / wavelen - low) / (high - low)  # 0 at the long-wavelength edge, 1 at the short
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    stretched = torch.where(wavelen > original / low, inv_freq / factor, blended)
    return torch.where(wavelen < original / high, inv_freq, stretched)


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype, scaling: tuple | None = None):
    """cos/sin tables of shape (seq_len, head_dim) in the rotate_half layout."""
    key = (seq_len, head_dim, theta, scaling, device, dtype)
    if key not in _ROPE_CACHE:
        if len(_ROPE_CACHE) >= 32:
            _ROPE_CACHE.clear()
        # A table made under inference_mode could not be saved for a later backward.
        with torch.inference_mode(False), torch.no_grad():
            inv_freq = rotary_frequencies(head_dim, theta, scaling, device)
            angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
            angles = torch.cat([angles, angles], dim=-1)  # pair i rotates x[i] with x[i + head_dim/2]
            _ROPE_CACHE[key] = angles.cos().to(dtype), angles.sin().to(dtype)
    return _ROPE_CACHE[key]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Hugging Face's rotate_half convention (halves, not interleaved pairs): their
    # checkpoints store q/k weights permuted for exactly this, so they load as-is.
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: (B, H, T, hd); k, v: (B, H_kv, T, hd) with H a multiple of H_kv."""
    n_rep = q.size(1) // k.size(1)
    if n_rep == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # enable_gqa saves copying the kv heads, but on CUDA only the flash and cuDNN
    # kernels take it, and they need half precision; in float32 it would fall back
    # to the math kernel, which builds the whole T x T score matrix (seen on torch 2.11).
    if _SDPA_HAS_GQA and q.dtype in (torch.float16, torch.bfloat16):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    # Query head i reads kv head i // n_rep, the same grouping enable_gqa uses.
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class TokenEmbedding(nn.Module):
    """(input_ids, targets) -> (hidden, targets). A bare id tensor means no targets."""

    def __init__(self, cfg: LlamaConfig, device: Device = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.max_seq_len = cfg.max_seq_len
        self.init_std = cfg.init_std
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)

    def forward(self, batch: Batch | torch.Tensor) -> Batch:
        input_ids, targets = (batch, None) if isinstance(batch, torch.Tensor) else batch
        if input_ids.size(-1) > self.max_seq_len:
            raise ValueError(f"sequence length {input_ids.size(-1)} exceeds max_seq_len {self.max_seq_len}")
        return F.embedding(input_ids, self.weight), targets


class DecoderBlock(nn.Module):
    """Pre-norm block: h + attn(norm(h)), then h + swiglu(norm(h))."""

    def __init__(self, cfg: LlamaConfig, device: Device = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        self.init_std = cfg.init_std
        # Projections that write into the residual stream get a smaller init so the
        # stream's variance does not grow with depth (GPT-2).
        self.out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        # skip_init: nn.Linear's own init would be overwritten by reset_parameters, and at billions
        # of parameters drawing every weight twice costs the model build minutes.
        # (skip_init needs a real device: None would leave the weights on "meta".)
        kw = dict(bias=False, device=torch.get_default_device() if device is None else device, dtype=dtype)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device, dtype)
        self.wq = skip_init(nn.Linear, cfg.dim, cfg.n_heads * cfg.head_dim, **kw)
        self.wk = skip_init(nn.Linear, cfg.dim, cfg.n_kv_heads * cfg.head_dim, **kw)
        self.wv = skip_init(nn.Linear, cfg.dim, cfg.n_kv_heads * cfg.head_dim, **kw)
        self.wo = skip_init(nn.Linear, cfg.n_heads * cfg.head_dim, cfg.dim, **kw)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, device, dtype)
        self.w1 = skip_init(nn.Linear, cfg.dim, cfg.ffn_hidden, **kw)  # gate
        self.w3 = skip_init(nn.Linear, cfg.dim, cfg.ffn_hidden, **kw)  # up
        self.w2 = skip_init(nn.Linear, cfg.ffn_hidden, cfg.dim, **kw)  # down
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.wq, self.wk, self.wv, self.w1, self.w3):
            nn.init.normal_(lin.weight, std=self.init_std)
        for lin in (self.wo, self.w2):
            nn.init.normal_(lin.weight, std=self.out_std)
        self.attn_norm.reset_parameters()
        self.mlp_norm.reset_parameters()

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary_cos_sin(T, self.head_dim, self.rope_theta, x.device, x.dtype, self.rope_scaling)
        y = causal_attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def forward(self, batch: Batch) -> Batch:
        h, targets = batch
        h = h + self.attention(self.attn_norm(h))
        h = h + self.mlp(self.mlp_norm(h))
        return h, targets
