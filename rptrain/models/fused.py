"""The decoder's memory-bound elementwise work as pure functions, compiled when `DecoderConfig.fused` is on.

Between its matmuls a decoder layer runs chains of small ops: RMSNorm is six kernels forward (a cast to
float32, square, mean, rsqrt, scale, cast back, weight), rotary embedding five per tensor, SwiGLU two,
the LM-head loss a handful over (tokens x vocab) float32 logits. Each reads and writes the whole
activation, so at 4 x 4096 tokens they cost memory bandwidth, not FLOPs. `torch.compile` (inductor)
turns each chain into one or two kernels forward and as few backward.

Why free functions with the weights as arguments, not `torch.compile(module)`: the engine deep-copies
every layer into per-device shells whose parameters are rebound (`p.data = ...`) before each job
(rptrain.engine.replica) and records CUDA graphs of the last stage (rptrain.engine.graphs). A compiled
function that captures no module state sees a rebound weight as just another input (guards on shape,
dtype, device, requires_grad; never on identity or address), and its kernels replay in a graph like
any op. Unfused, the modules call the very same functions eagerly, so the math is defined once here.

Recompiles: `dynamic=None` compiles the first shape statically and, when a second shape of the same
function arrives (another microbatch size or sequence length, the last loss chunk), once more with
the changed sizes symbolic, which then serves every further size. Grad mode and which inputs require
grad are guarded too (training, no_grad recompute and LoRA's frozen weights are separate entries);
all of that stays well inside dynamo's recompile limit (8 per function).
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.nn.functional as F

from rptrain.models.rope import apply_rotary

Fn = TypeVar("Fn", bound=Callable)
_COMPILED: dict[Callable, Callable] = {}


def kernel(fn: Fn, fused: bool) -> Fn:
    """`fn` itself, or (fused) its compiled version: one per function and process, made on first use so
    that importing the models never imports dynamo."""
    if not fused:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=None)
    return _COMPILED[fn]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    # Mean of squares in float32: fp16 overflows and bf16 is too coarse for it.
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:  # Gemma multiplies in float32, then casts
        return (normed * (1.0 + weight.float())).type_as(x)
    return weight * normed.type_as(x)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, its RMSNorm): the residual stream and the next sublayer's input from one read."""
    h = h + delta
    return h, rms_norm(h, weight, eps, offset)


def qk_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
              k_weight: torch.Tensor | None, eps: float, offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, T, H, hd), k (B, T, H_kv, hd) -> both (B, heads, T, hd), rotated; first normed per head when
    q_weight/k_weight are given (Qwen3, Gemma-3's q/k norms)."""
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps, offset), rms_norm(k, k_weight, eps, offset)
    return apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin)


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated MLP's product: silu(gate) * up (SwiGLU) or gelu_tanh(gate) * up (GeGLU)."""
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up
