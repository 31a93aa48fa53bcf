"""Low-precision number formats of the optimizer: stochastic rounding to bf16, block-wise 8-bit moments.

Pure functions of tensors (eager: adam_lowp.py; the same formulas in cpu_kernel.py and triton_step.py), on
any device. Constant divisors are multiplications by their reciprocal: torch's CUDA division by a Python
number does that, its CPU division does not, and triton_step.py must match both bit for bit.

Stochastic rounding: an fp32 value between two bf16 neighbours rounds up with probability equal to its
distance from the lower one, so the rounded value is unbiased and small updates to a bf16 master
accumulate in expectation instead of vanishing. The random bits are a hash of the element's index
and a seed (the step and the run), not a generator's state: a resumed run draws the same bits, and
nothing random has to be saved.

8-bit moments, in blocks of ``BLOCK`` elements with one fp32 scale each (the block's largest
magnitude). The maps keep small values, as torchao's and bitsandbytes' dynamic maps do, with a
closed form instead of a lookup table (an elementwise formula compiles into one loop):
- first moment (signed): ``q = round(127 sqrt(|m| / scale)) sign(m)``, ``m = (q / 127)^2 scale``;
  the smallest non-zero level is scale / 127^2 (and scale / 254^2 rounds to it).
- second moment (non-negative): ``q = round(255 (v / scale)^(1/4))``, ``v = (q / 255)^4 scale``: the
  square root of ``v`` (the update's denominator) gets the first moment's square-root map with twice
  the levels. A non-zero ``v`` never codes as 0, so no update divides by eps alone.
The optimizer rounds codes stochastically in value space (``_code``), with random bits like the master's
(another salt), so the decoded moments are unbiased and keep following small changes. One hash serves both
moments' codes (``moment_uniforms``): the hashes were 5-8% of the CPU step's time, and 16 bits a draw leave a
bias below 2^-16 of a code step.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

BLOCK = 64  # elements per scale: 256 (torchao's) let small moments in a block of large ones lose too much (docs/low-memory-state.md)
_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # a 32-bit avalanche multiplier (< 2^27: products stay below 2^59 in int64)
_TINY = torch.finfo(torch.float32).tiny


def hash32(index: Tensor, seed: Tensor) -> Tensor:
    """32 well-mixed bits (int64 in [0, 2^32)) per ``index`` (int64) and ``seed`` (int64 0-d)."""
    x = (index ^ seed) & _M32
    x = (((x >> 16) ^ x) * _MIX) & _M32
    x = (((x >> 16) ^ x) * _MIX) & _M32
    return (x >> 16) ^ x


def round_to_bf16(x: Tensor, index: Tensor, seed: Tensor) -> Tensor:
    """fp32 ``x`` stochastically rounded to bf16: 16 random bits added below bf16's last bit, then cut."""
    noise = (hash32(index, seed) & 0xFFFF).to(torch.int32)
    bits = (x.contiguous().view(torch.int32) + noise) & -65536  # -65536: 0xFFFF0000 as int32
    return bits.view(torch.float32).to(torch.bfloat16)


def moment_uniforms(index: Tensor, seed: Tensor) -> tuple[Tensor, Tensor]:
    """Two fp32 in [0, 1) per ``index``, from one hash32: its low 16 bits (the first moment's code) and its high 16
    (the second's). Sharing the hash made the CPU's 8-bit step 7-11% faster on one core (0.85-0.91 -> 0.79-0.81 ns a
    parameter, 3-7% at two; CI's AMD EPYC, bench/optim_lowp.py alternating old and new, 2026-12-07)."""
    bits = hash32(index, seed)
    return (bits & 0xFFFF).to(torch.float32) * 2.0**-16, (bits >> 16).to(torch.float32) * 2.0**-16


def _code(a: Tensor, level: Tensor, top: int, square_twice: bool, u: Optional[Tensor]) -> Tensor:
    """The code of ``a`` (a value over its block's scale, in [0, 1]) whose map position is ``level``: to
    nearest without ``u``; with ``u``, the code below or above with the probability that makes the decoded
    value unbiased (value-space stochastic rounding). Deterministic rounding stalls a moving average:
    a change smaller than half a code step (beta2 = 0.999 moves v by 0.1% a step, the fourth-root map's
    step near the top is 1.6%) is rounded away every step, so a moment only ever follows large changes."""
    if u is None:
        return level.round()
    lo = level.floor().clamp_max(top - 1)
    t, t1 = lo * (1 / top), (lo + 1) * (1 / top)
    below, above = t * t, t1 * t1
    if square_twice:
        below, above = below * below, above * above
    return lo + (a - below > u * (above - below)).to(torch.float32)


def quantize_signed(x: Tensor, u: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """fp32 ``x`` (numel a multiple of BLOCK) -> (int8 codes like ``x``, fp32 scale per block); with ``u`` (a
    uniform in [0, 1) per element), stochastically rounded (``_code``), else to nearest."""
    blocks = x.view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1)
    a = blocks.abs() / scale.clamp_min(_TINY)[:, None]
    u = None if u is None else u.view(-1, BLOCK)
    return (_code(a, a.sqrt() * 127, 127, False, u) * blocks.sign()).to(torch.int8).view(x.shape), scale


def dequantize_signed(q: Tensor, scale: Tensor) -> Tensor:
    level = q.view(-1, BLOCK).float() * (1 / 127)
    return (level * level.abs() * scale[:, None]).view(q.shape)


def quantize_unsigned(x: Tensor, u: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Non-negative fp32 ``x`` -> (uint8 codes, fp32 scale per block); non-zero values code at least 1; ``u`` as
    quantize_signed's."""
    blocks = x.view(-1, BLOCK)
    scale = blocks.amax(dim=1)
    a = blocks / scale.clamp_min(_TINY)[:, None]
    u = None if u is None else u.view(-1, BLOCK)
    level = torch.where(blocks > 0, _code(a, a.sqrt().sqrt() * 255, 255, True, u).clamp_min(1), 0.0)
    return level.to(torch.uint8).view(x.shape), scale


def dequantize_unsigned(q: Tensor, scale: Tensor) -> Tensor:
    level = q.view(-1, BLOCK).float() * (1 / 255)
    level = level * level
    return (level * level * scale[:, None]).view(q.shape)
