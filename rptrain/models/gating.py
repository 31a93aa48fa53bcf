"""The MoE experts' gated activation (between their two grouped GEMMs) as one Triton kernel forward and one
backward.

Eager, it is a chain of elementwise ops over the (rows, 2I) output of the first GEMM, each reading and writing
the whole activation, and autograd's backward is as many again: on an H100 at 4 x 4096 tokens ~2.7 ms for
Qwen3-MoE's silu(gate) * up and ~10 ms in 27 launches for GPT-OSS's clamped SwiGLU, of a 14-32 ms layer.
Fused, the forward reads gate_up once and writes the output; the backward reads gate_up and the output's
gradient and writes gate_up's gradient, recomputing the activation instead of saving intermediates.

Layouts (rptrain.models.experts): silu's gate and up are the two halves of a row (Qwen3-MoE, Mixtral),
GPT-OSS's alternate column by column. The kernels compute in fp32 and store in the input's dtype.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the eager formula runs instead
    triton = None

BLOCK = 1024  # output elements per program


@functools.cache
def clamp_passes_at_bound() -> tuple[bool, bool]:
    """Whether this torch's clamp passes the gradient at the bound itself: (clamp(max=), clamp(min, max)).
    torch 2.14 passes none there; the GPU machine's torch 2.11 differed from the kernel that assumed so
    (gradients off at the planted bounds, 2026-12-06), so the kernel asks the torch it runs with."""
    with torch.enable_grad():  # first asked from inside a backward, where grad mode is off
        one_sided = torch.tensor([1.0], requires_grad=True)
        one_sided.clamp(max=1.0).sum().backward()
        two_sided = torch.tensor([1.0, -1.0], requires_grad=True)
        two_sided.clamp(-1.0, 1.0).sum().backward()
    return bool(one_sided.grad[0] == 1), bool((two_sided.grad == 1).all())


def eager(gate_up: Tensor, activation: str, alpha: float, limit: float) -> Tensor:
    """The formula itself (CPU, no Triton, and the tests' reference)."""
    if activation == "silu":
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # GPT-OSS: clamped, and up shifted by one
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


if triton is not None:

    @triton.jit
    def _offsets(I: tl.constexpr, SILU: tl.constexpr, B: tl.constexpr):
        """The program's output elements and where their gate and up lie in gate_up (int64: rows x 2I may pass
        2^31). Interleaved, element e's pair is gate_up's flat 2e, 2e + 1: two strided accesses, which the caches
        merge (replacing a tl.reshape/tl.split of one load and a tl.join for the store while the clamp convention
        was being found; not timed against them)."""
        e = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
        if SILU:
            gate = (e // I) * (2 * I) + e % I
            up = gate + I
        else:
            gate = 2 * e
            up = gate + 1
        return e, gate, up

    @triton.jit
    def _load(ptr, e, gate, up, n):
        g = tl.load(ptr + gate, mask=e < n, other=0.0).to(tl.float32)
        u = tl.load(ptr + up, mask=e < n, other=0.0).to(tl.float32)
        return g, u

    @triton.jit
    def _clamped(g, u, limit):
        """GPT-OSS's clamps; NaN propagates, as torch.clamp's does."""
        g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        return g, tl.clamp(u, -limit, limit, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _forward(x_ptr, out_ptr, n, alpha, limit, I: tl.constexpr, SILU: tl.constexpr, B: tl.constexpr):
        e, gate, up = _offsets(I, SILU, B)
        g, u = _load(x_ptr, e, gate, up, n)
        if SILU:
            out = g / (1.0 + tl.exp(-g)) * u  # torch's silu: x / (1 + exp(-x))
        else:
            g, u = _clamped(g, u, limit)
            out = (u + 1.0) * (g * (1.0 / (1.0 + tl.exp(-(g * alpha)))))
        tl.store(out_ptr + e, out.to(out_ptr.dtype.element_ty), mask=e < n)

    @triton.jit
    def _backward(x_ptr, dout_ptr, dx_ptr, n, alpha, limit, I: tl.constexpr, SILU: tl.constexpr, B: tl.constexpr,
                  GATE_AT_BOUND: tl.constexpr, UP_AT_BOUND: tl.constexpr):
        e, gate, up = _offsets(I, SILU, B)
        g, u = _load(x_ptr, e, gate, up, n)
        dout = tl.load(dout_ptr + e, mask=e < n, other=0.0).to(tl.float32)
        if SILU:
            s = 1.0 / (1.0 + tl.exp(-g))
            du = dout * (g * s)
            dg = dout * u * s * (1.0 + g * (1.0 - s))  # torch's silu_backward
        else:
            # Inside its bounds torch's clamp passes the gradient; at a bound itself as clamp_passes_at_bound
            # says; for NaN never.
            gc, uc = _clamped(g, u, limit)
            s = 1.0 / (1.0 + tl.exp(-(gc * alpha)))
            up_in = ((u >= -limit) & (u <= limit)) if UP_AT_BOUND else ((u > -limit) & (u < limit))
            gate_in = (g <= limit) if GATE_AT_BOUND else (g < limit)
            du = tl.where(up_in, dout * (gc * s), 0.0)
            dg = tl.where(gate_in, dout * (uc + 1.0) * (s + gc * alpha * s * (1.0 - s)), 0.0)
        tl.store(dx_ptr + gate, dg.to(dx_ptr.dtype.element_ty), mask=e < n)
        tl.store(dx_ptr + up, du.to(dx_ptr.dtype.element_ty), mask=e < n)


class _Gated(torch.autograd.Function):
    """Saves only gate_up: the backward recomputes the activation from it."""

    @staticmethod
    def forward(ctx, gate_up: Tensor, activation: str, alpha: float, limit: float) -> Tensor:
        gate_up = gate_up.contiguous()
        ctx.save_for_backward(gate_up)
        ctx.args = (activation, float(alpha), float(limit))
        out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.size(-1) // 2)
        _launch(_forward, gate_up, (out,), *ctx.args)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (gate_up,) = ctx.saved_tensors
        grad_gate_up = torch.empty_like(gate_up)
        gate_at, up_at = clamp_passes_at_bound()
        _launch(_backward, gate_up, (grad.contiguous(), grad_gate_up), *ctx.args, GATE_AT_BOUND=gate_at, UP_AT_BOUND=up_at)
        return grad_gate_up, None, None, None


def _launch(kernel, gate_up: Tensor, tensors: tuple[Tensor, ...], activation: str, alpha: float, limit: float, **flags: bool) -> None:
    """``kernel`` over gate_up's output elements; ``tensors``: its other pointers in order (forward: the output;
    backward: the output's gradient, then gate_up's)."""
    n = gate_up.numel() // 2  # output elements, from the shape: no device read, so CUDA graphs capture it
    if not n:  # tokens = 0: nothing to launch
        return
    # Triton launches on the current device, which need not be gate_up's (one stage per GPU)
    with torch.cuda.device(gate_up.device) if gate_up.is_cuda else contextlib.nullcontext():
        kernel[(triton.cdiv(n, BLOCK),)](gate_up, *tensors, n, alpha, limit,
                                         I=gate_up.size(-1) // 2, SILU=activation == "silu", B=BLOCK, **flags)


def fused(gate_up: Tensor, activation: str, alpha: float, limit: float) -> Tensor:
    """The Triton path on any device Triton runs on (tests: the CPU under TRITON_INTERPRET=1)."""
    return _Gated.apply(gate_up, activation, alpha, limit)


def gated_activation(gate_up: Tensor, activation: str, alpha: float, limit: float) -> Tensor:
    """gate_up (..., 2I) -> (..., I): silu(gate) * up ("silu") or GPT-OSS's clamped SwiGLU."""
    if triton is not None and gate_up.is_cuda:
        return fused(gate_up, activation, alpha, limit)
    return eager(gate_up, activation, alpha, limit)
