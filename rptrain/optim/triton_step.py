"""The GPU share's low-precision Adam(W) step as one Triton kernel per flat run (plain ``triton.jit``: no
dynamo, so it cannot disturb ``model.fused``'s compiled kernels the way torch.compile on the optimizer
thread did, adam_lowp.py).

Each program takes ``ROWS`` blocks of ``BLOCK`` elements as a 2-D tile: parameter, gradient and moments
are read once, the update is computed in fp32, the block's new 8-bit scale is the row's maximum, and
everything is written back once. The formulas, their order of operations and the random bits are
adam_lowp.py's eager ones (lowbit.hash32 of the element's index and the step's seed), with IEEE
division and square root and no fused multiply-add, so the result is bit for bit the eager step's
(tests/test_optim_triton.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .lowbit import BLOCK

try:
    import triton
    import triton.language as tl
except ImportError:  # the eager formulas run instead
    triton = None

ROWS = 32  # blocks per program: 2,048 elements, 8 KB of fp32 per operand in registers
_STATE_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def available(p: Tensor) -> bool:
    """Whether a run on ``p``'s device can take the Triton step."""
    return triton is not None and p.is_cuda


if triton is not None:

    @triton.jit
    def _hash32(x):
        """lowbit.hash32 in 32-bit unsigned arithmetic (``x``: index ^ seed, already uint32)."""
        x = ((x >> 16) ^ x) * 0x45D9F3B
        x = ((x >> 16) ^ x) * 0x45D9F3B
        return (x >> 16) ^ x

    @triton.jit
    def _round_to_bf16(x, index, seed):
        """lowbit.round_to_bf16: 16 random bits added below bf16's last bit, then cut."""
        noise = _hash32(((index ^ seed) & 0xFFFFFFFF).to(tl.uint32)) & 0xFFFF
        bits = ((x.to(tl.uint32, bitcast=True) + noise) >> 16) << 16
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)

    @triton.jit
    def _code(a, level, top, inv_top, SQUARE_TWICE: tl.constexpr, u):
        """lowbit._code with ``u``: the code below or above, unbiased in value."""
        lo = tl.minimum(tl.floor(level), top - 1.0)
        t = lo * inv_top
        t1 = (lo + 1.0) * inv_top
        below = t * t
        above = t1 * t1
        if SQUARE_TWICE:
            below = below * below
            above = above * above
        return lo + tl.where(a - below > u * (above - below), 1.0, 0.0)

    @triton.jit
    def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, h_ptr, seed_ptr, n, start,
                     STATE: tl.constexpr, DECOUPLED: tl.constexpr, P_BF16: tl.constexpr, B: tl.constexpr, R: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R).to(tl.int64)
        index = row[:, None] * B + tl.arange(0, B)[None, :]
        inside = index < n
        seed = tl.load(seed_ptr)  # int64 in [0, 2^32)
        at = index + start  # the element of the whole run: its random bits do not depend on where a chunk begins
        lr, beta1, beta2 = tl.load(h_ptr), tl.load(h_ptr + 1), tl.load(h_ptr + 2)
        eps, wd, c1, c2, inv = tl.load(h_ptr + 3), tl.load(h_ptr + 4), tl.load(h_ptr + 5), tl.load(h_ptr + 6), tl.load(h_ptr + 7)

        p = tl.load(p_ptr + index, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + index, mask=inside, other=0.0).to(tl.float32) * inv
        if STATE == 2:  # 8-bit codes over whole blocks (the buffers are padded), a scale per block
            has_row = row < (n + B - 1) // B
            in_rows = has_row[:, None] & (index >= 0)
            level = tl.load(m_ptr + index, mask=in_rows, other=0).to(tl.float32) * 0.007874015748031496
            m = level * tl.abs(level) * tl.load(ms_ptr + row, mask=has_row, other=0.0)[:, None]
            level = tl.load(v_ptr + index, mask=in_rows, other=0).to(tl.float32) * 0.00392156862745098
            level = level * level
            v = level * level * tl.load(vs_ptr + row, mask=has_row, other=0.0)[:, None]
        else:
            m = tl.load(m_ptr + index, mask=inside, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + index, mask=inside, other=0.0).to(tl.float32)

        if DECOUPLED:
            p = p * (1.0 - lr * wd)
        else:
            g = g + wd * p
        m = m + (g - m) * (1.0 - beta1)
        v = v * beta2 + g * g * (1.0 - beta2)
        p = p - tl.div_rn((tl.div_rn(lr, c1)) * m, tl.div_rn(tl.sqrt_rn(v), c2) + eps)

        if P_BF16:
            tl.store(p_ptr + index, _round_to_bf16(p, at, seed), mask=inside)
        else:
            tl.store(p_ptr + index, p, mask=inside)
        if STATE == 0:
            tl.store(m_ptr + index, m, mask=inside)
            tl.store(v_ptr + index, v, mask=inside)
        elif STATE == 1:
            tl.store(m_ptr + index, _round_to_bf16(m, at, seed ^ 0x5BD1E995), mask=inside)
            tl.store(v_ptr + index, _round_to_bf16(v, at, seed ^ 0x27D4EB2F), mask=inside)
        else:
            tiny = 1.1754943508222875e-38
            bits = _hash32(((at ^ (seed ^ 0x5BD1E995)) & 0xFFFFFFFF).to(tl.uint32))  # lowbit.moment_uniforms
            m_u = (bits & 0xFFFF).to(tl.float32) * 1.52587890625e-05
            v_u = (bits >> 16).to(tl.float32) * 1.52587890625e-05
            m_scale = tl.max(tl.abs(m), axis=1)
            a = tl.div_rn(tl.abs(m), tl.maximum(m_scale, tiny)[:, None])
            code = _code(a, tl.sqrt_rn(a) * 127.0, 127.0, 0.007874015748031496, False, m_u)
            tl.store(m_ptr + index, tl.where(m < 0, -code, code).to(tl.int8), mask=in_rows)
            tl.store(ms_ptr + row, m_scale, mask=has_row)
            v_scale = tl.max(v, axis=1)
            a = tl.div_rn(v, tl.maximum(v_scale, tiny)[:, None])
            code = _code(a, tl.sqrt_rn(tl.sqrt_rn(a)) * 255.0, 255.0, 0.00392156862745098, True, v_u)
            code = tl.where(v > 0, tl.maximum(code, 1.0), 0.0)
            tl.store(v_ptr + index, code.to(tl.uint8), mask=in_rows)
            tl.store(vs_ptr + row, v_scale, mask=has_row)


def step(p: Tensor, g: Tensor, state: dict[str, Tensor], seed: Tensor, h: Tensor, decoupled: bool, start: int = 0) -> None:
    """adam_lowp.step_run's update of one flat run on a GPU, in one launch; ``seed``: its int64 0-d seed tensor;
    ``start``: the element of the whole run ``p`` begins at (a multiple of the block; optim/assist.py's chunks)."""
    n = p.numel()
    kind = _STATE_KIND[state["exp_avg"].dtype]
    scales: tuple[Optional[Tensor], Optional[Tensor]] = (state.get("exp_avg_scale"), state.get("exp_avg_sq_scale"))
    m_scale = scales[0] if scales[0] is not None else h  # a placeholder pointer: never read without 8-bit state
    v_scale = scales[1] if scales[1] is not None else h
    grid = (triton.cdiv(triton.cdiv(n, BLOCK), ROWS),)
    _adam_kernel[grid](p, g, state["exp_avg"], state["exp_avg_sq"], m_scale, v_scale, h, seed, n, start,
                       STATE=kind, DECOUPLED=decoupled, P_BF16=p.dtype == torch.bfloat16, B=BLOCK, R=ROWS,
                       enable_fp_fusion=False)
