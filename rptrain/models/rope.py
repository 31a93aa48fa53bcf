"""Rotary position embeddings: the frequency schedules of Hugging Face's `rope_type`s, and the tables.

`Rope` holds one attention type's rotary settings (a Gemma-3 model has two: local and global).
Frequencies follow transformers' definitions exactly (default, linear, dynamic, yarn, llama3) so
checkpoints trained with them load as they were trained. Positions come per token, so packed
sequences can restart at 0 at each example's start.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)  # frozen: hashable, so it can key the table cache
class Rope:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    # llama3: wavelengths above original/low_freq_factor are stretched by factor, those below
    # original/high_freq_factor kept, the band between blended.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    max_position_embeddings: int = 2048  # dynamic: rescales only past this length
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0  # the leading fraction of each head that rotates

    def __post_init__(self):
        if self.type not in ROPE_TYPES:
            raise ValueError(f"rope type {self.type!r} is not supported: use one of {', '.join(ROPE_TYPES)}")
        if self.type != "default" and self.factor < 1:
            raise ValueError(f"rope factor {self.factor} must be >= 1")
        if self.type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError("llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor")


def rotary_dim(rope: Rope, head_dim: int) -> int:
    return int(head_dim * rope.partial_rotary_factor)


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(rope: Rope, dim: int, device) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies, keep the high ones, ramp between (as transformers)."""
    factor, base, original = rope.factor, rope.theta, rope.original_max_position_embeddings
    scaling = rope.attention_factor
    if scaling is None:
        scaling = _mscale(factor, rope.mscale) / _mscale(factor, rope.mscale_all_dim) if rope.mscale and rope.mscale_all_dim else _mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided by factor)
    return (1 / (factor * pos_freqs)) * (1 - keep) + (1 / pos_freqs) * keep, float(scaling)


def inverse_frequencies(rope: Rope, head_dim: int, seq_len: int, device=None) -> tuple[torch.Tensor, float]:
    """(radians per position of each rotated pair, the factor cos/sin are multiplied by).

    seq_len (longest position + 1) matters only to `dynamic`, which rescales the base for
    sequences past max_position_embeddings (transformers does the same per call).
    """
    dim = rotary_dim(rope, head_dim)
    if rope.type == "yarn":
        return _yarn(rope, dim, device)
    base = rope.theta
    if rope.type == "dynamic" and seq_len > rope.max_position_embeddings:
        ratio = rope.factor * seq_len / rope.max_position_embeddings - (rope.factor - 1)
        base = base * ratio ** (dim / (dim - 2))
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    if rope.type == "llama3":
        factor, low, high, original = rope.factor, rope.low_freq_factor, rope.high_freq_factor, rope.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        blend = (original / wavelen - low) / (high - low)  # 0 at the long-wavelength edge, 1 at the short
        blended = (1 - blend) * inv_freq / factor + blend * inv_freq
        stretched = torch.where(wavelen > original / low, inv_freq / factor, blended)
        inv_freq = torch.where(wavelen < original / high, inv_freq, stretched)
    return inv_freq, 1.0


# Tables depend only on shapes, so they are cached per process rather than stored as module
# buffers, which the pipeline engine would upload with every stage.
_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rotary_table(rope: Rope, head_dim: int, length: int, device: torch.device, dtype: torch.dtype):
    """cos/sin of positions 0..length-1, shape (length, rotary_dim), in the rotate_half layout."""
    key = (rope, head_dim, length, device, dtype)
    if key not in _CACHE:
        if len(_CACHE) >= 64:
            _CACHE.clear()
        # A table made under inference_mode could not be saved for a later backward.
        with torch.inference_mode(False), torch.no_grad():
            inv_freq, scaling = inverse_frequencies(rope, head_dim, length, device)
            angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
            angles = torch.cat([angles, angles], dim=-1)  # pair i rotates x[i] with x[i + dim/2]
            _CACHE[key] = (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)
    return _CACHE[key]


def rotary_cos_sin(rope: Rope, head_dim: int, positions: torch.Tensor | None, T: int, device, dtype):
    """cos/sin for (B, T) positions, shaped (B, 1, T, dim) to broadcast over heads; (T, dim) for 0..T-1."""
    # Packed rows read the row's table: no device sync (CUDA graphs capture this). For dynamic rope that
    # scales by the row length, where transformers would see each example's own: the two differ only
    # for rows longer than max_position_embeddings.
    cos, sin = rotary_table(rope, head_dim, T, device, dtype)
    if positions is None:
        return cos, sin
    return cos[positions][:, None], sin[positions][:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Hugging Face's rotate_half convention (halves, not interleaved pairs): their checkpoints store
    # q/k weights permuted for exactly this, so they load as-is. Dimensions past cos's rotate not
    # (partial rotary).
    dim = cos.size(-1)
    rot, rest = (x, None) if dim == x.size(-1) else (x[..., :dim], x[..., dim:])
    x1, x2 = rot.chunk(2, dim=-1)
    out = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return out if rest is None else torch.cat([out, rest], dim=-1)
