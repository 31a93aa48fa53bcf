"""The MoE experts' last step: each token's k expert outputs, back from expert order, weighted and summed.

Eager it is three passes over the (rows, D) expert outputs and their backward as many again: a gather into
token order, a broadcast multiply by the routing weights, a reduction over k; then the multiply's two
gradients and the gather's inverse. On an H100 at 4 x 4096 tokens (Qwen3-30B-A3B, 2026-12-06, bench/moe_experts.py
--profile) the multiply and its backward were 2.1 ms in three launches, the gathers 1.5 ms and the reductions
0.6 ms of a 13.3 ms layer whose GEMMs take 8.0 ms. Fused (Triton, on CUDA), the forward reads each row where the
experts left it and writes the token's sum; the backward writes each row's gradient in expert order and each
weight's gradient (a dot product) in one pass each, with fp32 arithmetic throughout.

``order`` sorts the flat (token, choice) pairs by expert; ``inverse`` is its inverse: token t's choice j is row
``inverse[t * k + j]`` of the expert outputs, and row r holds pair ``order[r]``.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the eager formula runs instead
    triton = None

BLOCK_D = 1024  # columns per program


class _Permute(torch.autograd.Function):
    """Rows reordered by a permutation; the backward applies the inverse permutation (a gather, no atomics)."""

    @staticmethod
    def forward(ctx, y: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return y.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def eager(y: Tensor, weights: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
    """The formula in torch ops (CPU, no Triton, and the tests' reference): elementwise and a reduction over k
    with fp32 accumulation, no atomic adds (a batched GEMV of (1, k) by (k, D) ran at a twentieth of the memory
    bandwidth on an H100: 3.5 ms of GPT-OSS-20B's 42 ms layer at 4 x 4096)."""
    tokens, k = weights.shape
    per_token = _Permute.apply(y, inverse, order).view(tokens, k, y.size(-1))
    return (per_token * weights.to(y.dtype).unsqueeze(-1)).sum(1)


if triton is not None:

    @triton.jit
    def _forward(y_ptr, inverse_ptr, w_ptr, out_ptr, D, K: tl.constexpr, B: tl.constexpr, WEIGHTED: tl.constexpr):
        """Token t's row: its k rows of y summed, each times its weight where WEIGHTED."""
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * B + tl.arange(0, B)
        inside = d < D
        acc = tl.zeros([B], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(inverse_ptr + t * K + j).to(tl.int64)
            part = tl.load(y_ptr + row * D + d, mask=inside, other=0.0).to(tl.float32)
            if WEIGHTED:
                part = part * tl.load(w_ptr + t * K + j).to(tl.float32)
            acc += part
        tl.store(out_ptr + t * D + d, acc.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _backward_rows(grad_ptr, order_ptr, w_ptr, dy_ptr, D, K: tl.constexpr, B: tl.constexpr):
        """Row r's gradient: its pair's weight times its token's output gradient, written in expert order."""
        r = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * B + tl.arange(0, B)
        inside = d < D
        pair = tl.load(order_ptr + r).to(tl.int64)
        w = tl.load(w_ptr + pair).to(tl.float32)
        g = tl.load(grad_ptr + (pair // K) * D + d, mask=inside, other=0.0).to(tl.float32)
        tl.store(dy_ptr + r * D + d, (w * g).to(dy_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _backward_weights(grad_ptr, y_ptr, inverse_ptr, dw_ptr, D: tl.constexpr, K: tl.constexpr, B: tl.constexpr):
        """Token t's k weight gradients: the dot products of its output gradient with its k expert rows. D is a
        compile-time constant (one per model): Triton 3.6's interpreter cannot take a runtime loop bound."""
        t = tl.program_id(0).to(tl.int64)
        for j in tl.static_range(K):
            row = tl.load(inverse_ptr + t * K + j).to(tl.int64)
            acc = tl.zeros([B], dtype=tl.float32)
            for start in range(0, D, B):
                d = start + tl.arange(0, B)
                inside = d < D
                g = tl.load(grad_ptr + t * D + d, mask=inside, other=0.0).to(tl.float32)
                acc += g * tl.load(y_ptr + row * D + d, mask=inside, other=0.0).to(tl.float32)
            tl.store(dw_ptr + t * K + j, tl.sum(acc, axis=0))


def _launch(kernel, grid: tuple[int, ...], like: Tensor, *args) -> None:
    if not grid[0]:  # no tokens: nothing to launch
        return
    # Triton launches on the current device, which need not be the tensors' (one stage per GPU)
    with torch.cuda.device(like.device) if like.is_cuda else contextlib.nullcontext():
        kernel[grid](*args)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, weights: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
        y, weights = y.contiguous(), weights.contiguous()
        tokens, k = weights.shape
        D = y.size(-1)
        out = y.new_empty(tokens, D)
        _launch(_forward, (tokens, triton.cdiv(D, BLOCK_D)), y, y, inverse, weights, out, D, k, BLOCK_D, True)
        ctx.save_for_backward(y, weights, order, inverse)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        y, weights, order, inverse = ctx.saved_tensors
        grad = grad.contiguous()
        tokens, k = weights.shape
        D = y.size(-1)
        dy = dw = None
        if ctx.needs_input_grad[0]:
            dy = torch.empty_like(y)
            _launch(_backward_rows, (y.size(0), triton.cdiv(D, BLOCK_D)), y, grad, order, weights, dy, D, k, BLOCK_D)
        if ctx.needs_input_grad[1]:
            dw = torch.empty(tokens, k, dtype=torch.float32, device=y.device)
            _launch(_backward_weights, (tokens,), y, grad, y, inverse, dw, D, k, BLOCK_D)
            dw = dw.to(weights.dtype)
        return dy, dw, None, None


def fused(y: Tensor, weights: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
    """The Triton path on any device Triton runs on (tests: the CPU under TRITON_INTERPRET=1)."""
    return _Combine.apply(y, weights, order, inverse)


def combine(y: Tensor, weights: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
    """y (rows, D) in expert order, weights (tokens, k) -> (tokens, D): sum over j of weights[t, j] * y[inverse[t k + j]]."""
    if triton is not None and y.is_cuda:
        return fused(y, weights, order, inverse)
    return eager(y, weights, order, inverse)


def fused_sum(rows: Tensor, inverse: Tensor, k: int) -> Tensor:
    """sum_rows' Triton path on any device Triton runs on (tests: the CPU under TRITON_INTERPRET=1)."""
    tokens, D = rows.size(0) // k, rows.size(-1)
    rows, out = rows.contiguous(), rows.new_empty(tokens, D)
    _launch(_forward, (tokens, triton.cdiv(D, BLOCK_D)), rows, rows, inverse, rows, out, D, k, BLOCK_D, False)
    return out


def sum_rows(rows: Tensor, inverse: Tensor, k: int) -> Tensor:
    """rows (tokens * k, D) in expert order -> (tokens, D): each token's k rows summed (fp32 accumulation). The
    backward of the experts' dispatch (experts.py), which copied each token to its k rows."""
    if triton is not None and rows.is_cuda:
        return fused_sum(rows, inverse, k)
    return rows.index_select(0, inverse).view(rows.size(0) // k, k, rows.size(-1)).sum(1)
