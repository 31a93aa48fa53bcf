"""Causal self-attention with the options decoders need: packed sequences, sliding windows,
logit soft-capping, grouped-query heads.

Packing: `segments` (B, T) gives every token the id of the example it belongs to; a token
attends only to earlier tokens of its own example (a contiguous run of equal ids), and rotary
positions restart at each run's start (`positions`). Without segments, windows or soft-capping
SDPA's is_causal kernel runs; otherwise SDPA with a boolean mask (FlexAttention block masks on
CUDA with model.attention=auto or flex), or the explicit computation when scores must be
soft-capped and flex is off (SDPA cannot). Everything here runs on the CPU as on a GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# SDPA learnt enable_gqa in torch 2.5; pyproject allows 2.4.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def _starts(segments: torch.Tensor) -> torch.Tensor:
    """True at each example's first token: wherever the id changes, so an id that reappears
    later is a new example, for the mask and the positions alike."""
    change = torch.ones_like(segments, dtype=torch.bool)
    change[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return change


def runs(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) ids -> (B, T) run numbers, one per contiguous example."""
    return _starts(segments).cumsum(1)


def positions(segments: torch.Tensor) -> torch.Tensor:
    """Position of each token within its run: 0 at each example's first token."""
    change = _starts(segments)
    index = torch.arange(segments.size(1), device=segments.device).expand_as(segments)
    start = torch.where(change, index, torch.zeros_like(index)).cummax(1).values
    return index - start


def attention_mask(T: int, device, segments: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """Boolean (B or 1, 1, T, T): True where query i may read key j."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)  # transformers: key within the last `window` tokens
    if segments is None:
        return allowed[None, None]
    r = runs(segments)
    return (allowed[None] & (r[:, :, None] == r[:, None, :]))[:, None]


_COMPILED: dict[str, object] = {}

# model.attention=auto: FlexAttention for packed or windowed rows on CUDA, SDPA's dense mask elsewhere.
# Measured on the H200 (2026-12-03, one device call, SDPA and flex each in its own bench/attention.py
# process), Llama-8B heads (32/8 x 128), bf16, 4 x 4096, documents of 128-1024 tokens, forward + backward
# per layer: compiled FlexAttention 2.40 ms against SDPA's dense mask 13.57 ms; its block mask costs 7.5 ms
# once per batch (all layers of a stage share it); one whole decoder layer, the mask built in every call,
# 45.0 ms against 54.1 (1.20x; 1.28x with Llama-3B heads).
AUTO_FLEX_ON_CUDA = True
# The CPU always takes SDPA: FlexAttention has no CPU backward (torch 2.14), and eager it is a slow reference.
# Nor do heads narrower than this: inductor's FlexAttention kernel refuses them (NotImplementedError, torch 2.11).
FLEX_MIN_HEAD_DIM = 16


def uses_flex(attention: str) -> bool:
    """Whether model.attention (auto | sdpa | flex) asks for FlexAttention where it can run (CUDA)."""
    return attention == "flex" or (attention == "auto" and AUTO_FLEX_ON_CUDA)


# One block mask per batch, not per layer: every layer of a stage gets the same segments tensor, so the
# mask built by the first is kept (per window) while that tensor is alive and unchanged.
_MASKS: dict[int | None, tuple] = {}


def _batch_block_mask(B: int, T: int, device, segments: torch.Tensor | None, window: int | None):
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return flex_block_mask(B, T, device, segments, window)  # a CUDA graph must rebuild it on every replay
    version = None if segments is None else segments._version
    hit = _MASKS.get(window)
    if hit is not None and hit[0] is segments and hit[1:4] == (version, B, T) and hit[4] == torch.device(device):
        return hit[5]
    mask = flex_block_mask(B, T, device, segments, window)
    _MASKS[window] = (segments, version, B, T, torch.device(device), mask)
    return mask


def flex_block_mask(B: int, T: int, device, segments: torch.Tensor | None = None, window: int | None = None):
    """FlexAttention's block mask for causal attention within each run of `segments` and `window`."""
    from torch.nn.attention.flex_attention import create_block_mask

    r = None if segments is None else runs(segments)

    def mask_mod(b, h, qi, ki):
        ok = ki <= qi
        if window is not None:
            ok = ok & (qi - ki < window)
        if r is not None:
            ok = ok & (r[b, qi] == r[b, ki])
        return ok

    return create_block_mask(mask_mod, None if r is None else B, None, T, T, device=device)


def flex_attention(q, k, v, scale=None, softcap=None, window=None, segments=None, compiled: bool = True, block_mask=None) -> torch.Tensor:
    """The same attention through FlexAttention: a block mask skips the blocks no query may read
    (other examples, outside the window), which SDPA's dense mask computes and discards. Compiled
    on CUDA (eager FlexAttention is a slow reference, and forward only on the CPU). `block_mask`:
    one built beforehand by `flex_block_mask` (else built from segments and window, once per batch)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    if block_mask is None:
        block_mask = _batch_block_mask(q.size(0), q.size(2), q.device, segments, window)
    score_mod = None if softcap is None else (lambda s, b, h, qi, ki: torch.tanh(s / softcap) * softcap)
    if compiled and "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex, dynamic=False)
    fn = _COMPILED["flex"] if compiled else flex
    return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=q.size(1) != k.size(1))


def _repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    n_rep = q.size(1) // k.size(1)
    if n_rep == 1:
        return k, v
    # Query head i reads kv head i // n_rep, the same grouping enable_gqa uses.
    return k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)


def explicit_attention(q, k, v, allowed: torch.Tensor, scale=None, softcap=None, sinks=None) -> torch.Tensor:
    """Scores, soft-capping, the mask, the sinks' extra column and the softmax written out (allowed: True where
    a query may read a key). Also the decoding step of generation (rptrain.models.generate)."""
    k, v = _repeat_kv(q, k, v)
    scores = (q @ k.transpose(-1, -2)) * (q.size(-1) ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)
    return probs[..., :-1].to(q.dtype) @ v


def sink_attention(q, k, v, sinks: torch.Tensor, scale=None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention whose softmax also holds a per-head logit that reads nothing (GPT-OSS's sinks), through SDPA's
    fused kernels instead of a written-out T x T softmax: the sink is one more key, in front, with value zero,
    that every query scores at exactly sinks[h] (q gets the feature sinks[h] / scale, the sink key a 1 there,
    the real keys a 0). A dummy query in front keeps is_causal's diagonal on the real tokens; features are
    padded to a multiple of 8, the fused kernels' granularity. mask: attention_mask's, or None for causal."""
    B, H, T, hd = q.shape
    scale = hd ** -0.5 if scale is None else scale
    width = (hd + 8) // 8 * 8  # hd + the sink feature, rounded up
    extra = (sinks.to(q.dtype) / scale).view(1, H, 1, 1).expand(B, H, T, 1)
    q = F.pad(torch.cat([q, extra], dim=-1), (0, width - hd - 1, 1, 0))
    sink_key = torch.zeros(k.size(0), k.size(1), 1, width, device=k.device, dtype=k.dtype)
    sink_key[..., hd] = 1
    k = torch.cat([sink_key, F.pad(k, (0, width - hd))], dim=2)
    v = F.pad(v, (0, width - hd, 1, 0))
    if mask is not None:
        mask = F.pad(mask, (1, 0, 1, 0), value=True)  # every query reads the sink; the dummy's output is dropped
    return _sdpa(q, k, v, scale, mask)[:, :, 1:, :hd]


def _sdpa(q, k, v, scale, mask: torch.Tensor | None) -> torch.Tensor:
    kw = dict(scale=scale, is_causal=mask is None, attn_mask=mask)
    # enable_gqa saves copying the kv heads, but on CUDA only the flash and cuDNN kernels take it,
    # and they need half precision and no mask; otherwise SDPA would fall back to the math kernel,
    # which builds the whole T x T score matrix (seen on torch 2.11).
    if q.size(1) != k.size(1) and _SDPA_HAS_GQA and mask is None and q.dtype in (torch.float16, torch.bfloat16):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    k, v = _repeat_kv(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    segments: torch.Tensor | None = None,
    flex: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (B, H, T, hd); k, v: (B, H_kv, T, hd) with H a multiple of H_kv. scale None: 1/sqrt(hd).
    flex: FlexAttention on CUDA for masked attention (packed rows, windows) with heads of at least
    FLEX_MIN_HEAD_DIM; SDPA elsewhere. sinks (H,): GPT-OSS's per-head logit that joins each softmax
    and is then dropped (sink_attention: SDPA with one more key; explicitly when soft-capped too)."""
    T = q.size(2)
    if window is not None and window >= T:
        window = None  # a window longer than the sequence masks nothing
    if flex and sinks is None and q.is_cuda and q.size(-1) >= FLEX_MIN_HEAD_DIM and (window is not None or segments is not None):
        return flex_attention(q, k, v, scale, softcap, window, segments)
    if softcap is not None:
        return explicit_attention(q, k, v, attention_mask(T, q.device, segments, window), scale, softcap, sinks)
    mask = None if window is None and segments is None else attention_mask(T, q.device, segments, window)
    if sinks is not None:
        return sink_attention(q, k, v, sinks, scale, mask)
    return _sdpa(q, k, v, scale, mask)
