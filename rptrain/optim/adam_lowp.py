"""Adam/AdamW over one flat run with a bf16 master and/or bf16 or 8-bit moments (lowbit.py's formats).

torch's fused kernels keep moments in the parameter's dtype and round a bf16 parameter to nearest,
which drops updates smaller than half a bf16 step; this step computes in fp32 and writes back in the
low formats: the bf16 master and bf16 moments stochastically rounded, 8-bit moments re-quantized per
block with stochastically rounded codes. It walks the run in chunks of ``CHUNK`` elements (a multiple of the block), so its fp32
temporaries stay small and in cache.

With ``compiled`` (the optimizers' ``compile_step``) a CPU run takes cpu_kernel.py's C++ loop, built at
first use; where it does not build the eager functions run (same formulas; results agree to rounding,
not bit for bit). A GPU run takes triton_step.py's kernel (one launch per run, bit for bit these
formulas) where Triton is installed, else the eager functions over chunks of ``GPU_CHUNK`` elements.
torch.compile is not used on the GPU: on the optimizer thread it broke the model's own compiled kernels
on the thread issuing the pass (dynamo's tracing flag is process-wide: "Detected that you are using FX
to symbolically trace a dynamo-optimized function", llama_8b with model.fused on the H200, 2026-12-04).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import assist, cpu_kernel, front, triton_step
from .lowbit import BLOCK, dequantize_signed, dequantize_unsigned, moment_uniforms, quantize_signed, quantize_unsigned, round_to_bf16

CHUNK = 1 << 18  # elements: 1 MiB per fp32 temporary (bench/optim_lowp.py)
_SEED_MIX = 0x9E3779B1
_M_SALT, _V_SALT = 0x5BD1E995, 0x27D4EB2F  # distinct random streams for the moments' rounding (bf16 or 8-bit codes)


def _adam(p32: Tensor, g32: Tensor, m: Tensor, v: Tensor, h: Tensor, decoupled: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One Adam(W) update in fp32, as torch's fused kernel computes it. ``h``: lr, beta1, beta2, eps,
    weight_decay, 1 - beta1^step, sqrt(1 - beta2^step), 1 / grad scale."""
    lr, beta1, beta2, eps, weight_decay, correction1, correction2_sqrt, inv_scale = h.unbind()
    g32 = g32 * inv_scale
    if decoupled:
        p32 = p32 * (1 - lr * weight_decay)
    else:
        g32 = g32 + weight_decay * p32
    m = m + (g32 - m) * (1 - beta1)
    v = v * beta2 + g32 * g32 * (1 - beta2)
    p32 = p32 - (lr / correction1) * m / (v.sqrt() / correction2_sqrt + eps)
    return p32, m, v


def _store_param(p: Tensor, p32: Tensor, index: Tensor, seed: Tensor) -> None:
    p.copy_(round_to_bf16(p32, index, seed) if p.dtype == torch.bfloat16 else p32)


def _chunk_float(p: Tensor, g: Tensor, m: Tensor, v: Tensor, h: Tensor, seed: Tensor, start: Tensor, decoupled: bool) -> None:
    """Moments in fp32 or bf16 (stochastically rounded)."""
    index = torch.arange(p.numel(), device=p.device) + start
    p32, m32, v32 = _adam(p.float(), g.float(), m.float(), v.float(), h, decoupled)
    _store_param(p, p32, index, seed)
    for state, value, salt in ((m, m32, _M_SALT), (v, v32, _V_SALT)):
        state.copy_(round_to_bf16(value, index, seed ^ salt) if state.dtype == torch.bfloat16 else value)


def _chunk_int8(p: Tensor, g: Tensor, mq: Tensor, ms: Tensor, vq: Tensor, vs: Tensor, h: Tensor, seed: Tensor, start: Tensor,
                decoupled: bool) -> None:
    """Moments in 8 bits with a scale per block (``p``, ``g``: a whole number of blocks)."""
    index = torch.arange(p.numel(), device=p.device) + start
    p32, m32, v32 = _adam(p.float(), g.float(), dequantize_signed(mq, ms), dequantize_unsigned(vq, vs), h, decoupled)
    _store_param(p, p32, index, seed)
    m_u, v_u = moment_uniforms(index, seed ^ _M_SALT)
    q, s = quantize_signed(m32, m_u)
    mq.copy_(q)
    ms.copy_(s)
    q, s = quantize_unsigned(v32, v_u)
    vq.copy_(q)
    vs.copy_(s)


# Elements of a host run stepped between two reports to a call that overlaps the step (front.py): about 7 ms
# of the 16-core host's C++ loop (0.41 ns a parameter, 2026-12-06), small against a 32 B layer's 0.2 s.
FRONT_PIECE = 1 << 24
GPU_CHUNK = 1 << 22  # 4 M elements: 16 MB per fp32 temporary (16 M ran a 14 B plan out of GPU memory, 2026-12-04)


def hyper(group: dict, step: Tensor, grad_scale: Optional[Tensor]) -> Tensor:
    """``_adam``'s ``h`` on the step's device, from the group and the (already incremented) step."""
    beta1, beta2 = group["betas"]
    s = step.double()
    inv = torch.ones((), dtype=torch.float64, device=step.device) if grad_scale is None else 1 / grad_scale.double()
    scalars = [torch.as_tensor(x, dtype=torch.float64, device=step.device)
               for x in (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])]
    return torch.stack([*scalars, 1 - beta1 ** s, (1 - beta2 ** s).sqrt(), inv.reshape(())]).float()


def step_run(p: Tensor, g: Tensor, state: dict[str, Tensor], step: Tensor, h: Tensor, run_key: int, decoupled: bool,
             compiled: bool, chunk: Optional[int] = None, start: int = 0) -> None:
    """One step of a flat run: ``p`` (master, fp32 or bf16) and ``g`` its gradient, 1-D; ``state``:
    exp_avg and exp_avg_sq flat (fp32 or bf16), or with 8 bits also their ``*_scale`` per block.
    ``run_key`` tells runs' random streams apart. ``chunk``: elements per call (a multiple of BLOCK; the
    result does not depend on it); None: CHUNK on the CPU, GPU_CHUNK on a GPU. ``start``: the element of
    the whole run ``p`` begins at (a multiple of BLOCK). A host run stepped while a GPU assists
    (assist.py) sends its first part through that GPU."""
    helper = assist.current() if p.device.type == "cpu" else None
    stop = helper.gpu_part(p.numel()) if helper is not None else 0
    if stop:
        _assisted(helper, stop, p, g, state, step, h, run_key, decoupled, compiled, chunk)
        return
    if p.device.type == "cpu" and p.numel() > FRONT_PIECE and front.current() is not None:
        _in_pieces(p, g, state, step, h, run_key, decoupled, compiled, chunk, start)
        return
    if compiled and p.device.type == "cpu":
        seed_int = (int(step.item()) * _SEED_MIX + run_key) & 0xFFFFFFFF
        if cpu_kernel.step(p, g, state, h, seed_int, decoupled, start):
            return
    seed = (step.to(torch.int64) * _SEED_MIX + run_key) & 0xFFFFFFFF
    if compiled and chunk is None and triton_step.available(p):
        triton_step.step(p, g, state, seed, h, decoupled, start)
        return
    n = p.numel()
    if chunk is None:
        chunk = GPU_CHUNK if p.device.type != "cpu" else CHUNK
    int8 = "exp_avg_scale" in state
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        at = torch.full((), start + a, dtype=torch.int64, device=p.device)
        pc, gc = p[a:b], g[a:b]
        if not int8:
            _chunk_float(pc, gc, state["exp_avg"][a:b], state["exp_avg_sq"][a:b], h, seed, at, decoupled)
            continue
        padded = -(-(b - a) // BLOCK) * BLOCK
        if padded != b - a:  # the run's last partial block: zero-padded copies (state buffers are padded already)
            pc = torch.cat([pc, pc.new_zeros(padded - (b - a))])
            gc = torch.cat([gc, gc.new_zeros(padded - (b - a))])
        blocks = slice(a // BLOCK, a // BLOCK + padded // BLOCK)
        _chunk_int8(pc, gc, state["exp_avg"][a : a + padded], state["exp_avg_scale"][blocks],
              state["exp_avg_sq"][a : a + padded], state["exp_avg_sq_scale"][blocks], h, seed, at, decoupled)
        if padded != b - a:
            p[a:b].copy_(pc[: b - a])


def _state_part(state: dict[str, Tensor], a: int, b: Optional[int]) -> dict[str, Tensor]:
    """The run's state for elements ``[a, b)`` (``a``, ``b`` on blocks; None: to the end, keeping the padding of
    the run's last block): per-element moments sliced by element, ``*_scale`` by block."""
    return {k: v[a // BLOCK : None if b is None else b // BLOCK] if k.endswith("_scale") else v[a:b] for k, v in state.items()}


def _in_pieces(p: Tensor, g: Tensor, state: dict[str, Tensor], step: Tensor, h: Tensor, run_key: int, decoupled: bool,
               compiled: bool, chunk: Optional[int], start: int) -> None:
    """A host run stepped in pieces of ``FRONT_PIECE``, each reported done as it ends (front.py): a call that
    overlaps this step reads a layer once its piece is written, not after the whole run."""
    n = p.numel()
    for a in range(0, n, FRONT_PIECE):
        b = min(a + FRONT_PIECE, n)
        with front.tracking(None):
            step_run(p[a:b], g[a:b], _state_part(state, a, b if b < n else None), step, h, run_key, decoupled, compiled, chunk, start + a)
        front.report(p[a:b])


def _assisted(helper: assist.Assist, stop: int, p: Tensor, g: Tensor, state: dict[str, Tensor], step: Tensor, h: Tensor,
              run_key: int, decoupled: bool, compiled: bool, chunk: Optional[int]) -> None:
    """The run's first ``stop`` elements (``helper.gpu_part``) stepped on the helper's GPU while the host steps the rest."""
    on_gpu_step, on_gpu_h = step.to(helper.device), h.to(helper.device)

    def piece(t: dict[str, Tensor], at: int) -> None:
        moments = {k: v for k, v in t.items() if k not in ("param", "grad")}
        with assist.assisting(None):  # (a piece on the CPU, in tests, is not split again)
            step_run(t["param"], t["grad"], moments, on_gpu_step, on_gpu_h, run_key, decoupled, compiled, start=at)

    wait = assist.stream_through(helper, {"param": p, "grad": g, **state}, stop, piece)
    try:
        rest = _state_part(state, stop, None)
        with assist.assisting(None):
            step_run(p[stop:], g[stop:], rest, step, h, run_key, decoupled, compiled, chunk, start=stop)
    finally:
        wait()


def padded_numel(numel: int) -> int:
    return -(-numel // BLOCK) * BLOCK


def blocks(numel: int) -> int:
    return math.ceil(numel / BLOCK)
