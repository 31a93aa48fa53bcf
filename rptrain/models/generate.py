"""Generation from a decoder nn.Sequential: greedy or sampled, with a KV cache.

`kv_cache(model)` swaps every decoder layer's `self_attn` (rptrain.models.decoder.SelfAttention) for
a `CachedAttention` around it while the block is open: the layers' own forwards (norms, MLP,
embedding, head) run unchanged, each attention keeps the keys and values it has seen and places the
new tokens' rotary positions after them. The prompt then runs once, and every new token costs one
token's forward. A model whose layers have no such attention generates by recomputing the prefix.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rptrain.models.attention import _repeat_kv, explicit_attention
from rptrain.models.decoder import SelfAttention
from rptrain.models.rope import apply_rotary, rotary_cos_sin


class CachedAttention(nn.Module):
    """SelfAttention's forward for tokens that follow the ones already cached (one sequence, no packing)."""

    def __init__(self, attn: SelfAttention) -> None:
        super().__init__()
        self.attn = attn
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor, segments: Optional[torch.Tensor] = None) -> torch.Tensor:
        a = self.attn
        B, T, _ = x.shape
        if hasattr(a, "qkv_proj"):
            q, k, v = a.qkv_proj(x).split(a.splits, dim=-1)
        else:
            q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
        q, k = q.view(B, T, a.n_heads, a.head_dim), k.view(B, T, a.n_kv_heads, a.head_dim)
        if hasattr(a, "q_norm"):
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        past = 0 if self.k is None else self.k.size(2)
        L = past + T
        pos = torch.arange(past, L, device=x.device).expand(B, T)
        cos, sin = rotary_cos_sin(a.rope, a.head_dim, pos, L, x.device, x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        i = torch.arange(past, L, device=x.device)[:, None]
        j = torch.arange(L, device=x.device)[None, :]
        allowed = j <= i
        if a.window is not None:
            allowed = allowed & (i - j < a.window)
        sinks = getattr(a, "sinks", None)
        if a.softcap is not None or sinks is not None:
            y = explicit_attention(q, self.k, self.v, allowed, a.scale, a.softcap, sinks)
        else:
            keys, values = _repeat_kv(q, self.k, self.v)
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=a.scale)
        return a.o_proj(y.transpose(1, 2).reshape(B, T, -1))


def cacheable(model: nn.Sequential) -> bool:
    layers = list(model)[1:-1]
    return bool(layers) and all(isinstance(getattr(layer, "self_attn", None), SelfAttention) for layer in layers)


@contextmanager
def kv_cache(model: nn.Sequential) -> Iterator[bool]:
    """Yields whether the model now decodes with a cache (fresh for this block); restores the layers after."""
    if not cacheable(model):
        yield False
        return
    layers = list(model)[1:-1]
    originals = [layer.self_attn for layer in layers]
    try:
        for layer, attn in zip(layers, originals):
            layer.self_attn = CachedAttention(attn)
        yield True
    finally:
        for layer, attn in zip(layers, originals):
            layer.self_attn = attn


def next_token(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator]) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@torch.no_grad()
def generate(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    prompt: Sequence[int],
    max_new_tokens: int,
    stop: Callable[[list[int]], bool] = lambda ids: False,
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
    max_seq_len: Optional[int] = None,
    device: torch.device | str = "cpu",
) -> list[int]:
    """New token ids after `prompt` (at most max_new_tokens; fewer when stop(new ids) says so).

    `model` maps (1, T) ids to (1, T, vocab) logits; an nn.Sequential decoder gets a KV cache when
    its layers allow, any other callable is called on the whole prefix at every step.
    """
    prompt = list(prompt)
    if max_seq_len is not None:
        prompt = prompt[-(max_seq_len - 1):] if max_seq_len > 1 else prompt[-1:]
        max_new_tokens = min(max_new_tokens, max_seq_len - len(prompt))
    out: list[int] = []
    cached = kv_cache(model) if isinstance(model, nn.Sequential) else _no_cache()
    with cached as use_cache:
        logits = model(torch.tensor([prompt], device=device))[0, -1]
        while len(out) < max_new_tokens:
            out.append(next_token(logits, temperature, generator))
            if stop(out) or len(out) == max_new_tokens:
                break
            step = out[-1:] if use_cache else prompt + out
            logits = model(torch.tensor([step], device=device))[0, -1]
    return out


@contextmanager
def _no_cache() -> Iterator[bool]:
    yield False
