"""rptrain.models.gating's Triton kernels (the MoE experts' gated activation) against autograd of the eager
formula in fp32: forward outputs and gate_up's gradient, fp32 and bf16 inputs, silu (halves) and GPT-OSS's
clamped SwiGLU (interleaved), 0, 1 and 37 rows, I = 6, 48 and 2880, with gate and up planted exactly at, one
step inside and one step beyond the clamp limits (at the bound itself, the kernel passes the gradient as the running
torch's clamp does: gating.clamp_passes_at_bound).

Tolerance, elementwise, with ref the fp32 autograd on the same (bf16-exact) inputs:
- fp32: |fused - ref| <= 2^-22 (|ref| + max |ref|), two fp32 steps of the value and of the tensor's largest
  element (measured: under half a step): exp and the order of operations differ by about a step, and silu's
  derivative crosses zero (gate ~ -1.28), where the error is a step of its terms, not of the result. On a GPU
  2^-19: Triton's exp and fp32 division there are the approximate ones (ex2.approx, div.full), not measured here.
- bf16: one bf16 step of |ref| more, 2^-7 on the CPU (Triton 3.8's interpreter casts fp32 to bf16 by cutting
  the mantissa) and 2^-8 on a GPU (round to nearest): one rounding of the fp32 result, none in between.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rptrain.models.gating import eager, fused, gated_activation

ROOT = Path(__file__).resolve().parents[1]
ALPHA, LIMIT = 1.702, 7.0  # GPT-OSS's
SHAPES = [(0, 48), (1, 6), (37, 6), (37, 48), (3, 2880)]  # (rows, I)


def inputs(rows: int, I: int, dtype: torch.dtype, activation: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up (rows, 2I), |values| up to ~16 (past the limit), its gate and up each holding the limits, a step
    inside and a step beyond them; the output's gradient."""
    gen = torch.Generator().manual_seed(rows * 10_000 + I)
    gate_up = (torch.randn(rows, 2 * I, generator=gen) * 4).to(dtype)
    bounds = torch.tensor([LIMIT, -LIMIT], dtype=dtype)
    special = torch.cat([bounds, torch.nextafter(bounds, bounds * 2), torch.nextafter(bounds, bounds / 2)])
    halves = gate_up.chunk(2, dim=-1) if activation == "silu" else (gate_up[:, ::2], gate_up[:, 1::2])
    for half in halves:
        half[:, :6] = special
    grad = (torch.randn(rows, I, generator=gen) * 2).to(dtype)
    return gate_up.to(device), grad.to(device)


def excess(got: torch.Tensor, want: torch.Tensor, device: str) -> float:
    """The largest amount by which fused ``got`` misses fp32 ``want``'s tolerance (the module docstring's)."""
    fp32 = 2.0**-22 if device == "cpu" else 2.0**-19
    step = 0.0 if got.dtype == torch.float32 else 2.0**-7 if device == "cpu" else 2.0**-8
    if not want.numel():
        return 0.0
    bound = step * want.abs() + (1 + step) * fp32 * (want.abs() + want.abs().max())
    return ((got.float() - want).abs() - bound).max().item()


def reference(gate_up: torch.Tensor, grad: torch.Tensor, activation: str, at_bound=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Autograd of the eager formula in fp32: (output, gate_up's gradient). ``at_bound``: (gate's, up's) clamp
    passes the gradient at the bound itself, instead of the running torch's convention (no NaN in the inputs)."""
    x = gate_up.detach().float().clone().requires_grad_()
    if at_bound is None or activation == "silu":
        out = eager(x, activation, ALPHA, LIMIT)
    else:
        gate, up = x[:, ::2], x[:, 1::2]
        gate = torch.where(gate <= LIMIT if at_bound[0] else gate < LIMIT, gate, gate.detach().clamp(max=LIMIT))
        inside = (up >= -LIMIT) & (up <= LIMIT) if at_bound[1] else (up > -LIMIT) & (up < LIMIT)
        up = torch.where(inside, up, up.detach().clamp(-LIMIT, LIMIT))
        out = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
    out.backward(grad.float())
    return out.detach(), x.grad


def mismatches(device: str, at_bound=None) -> list[tuple[str, float]]:
    """(case, largest excess over the tolerance) for every output or gradient outside it; [] when all agree.
    ``at_bound``: the kernel and the reference take this clamp convention (reference's), not the running torch's."""
    if at_bound is not None:
        from rptrain.models import gating
        gating.clamp_passes_at_bound = lambda: at_bound
    bad = []
    for activation in ("silu", "clamped_swiglu"):
        for dtype in (torch.float32, torch.bfloat16):
            for rows, I in SHAPES:
                gate_up, grad = inputs(rows, I, dtype, activation, device)
                x = gate_up.clone().requires_grad_()
                out = fused(x, activation, ALPHA, LIMIT)
                out.backward(grad)
                for name, got, want in zip(("output", "gradient"), (out, x.grad), reference(gate_up, grad, activation, at_bound)):
                    assert got.dtype == dtype and got.shape == want.shape
                    if excess(got, want, device) > 0:
                        bad.append((f"{activation} {dtype} rows={rows} I={I} {name}", excess(got, want, device)))
    return bad


def test_kernels_match_the_eager_formula_in_the_interpreter():
    """On the CPU under Triton's interpreter (set before triton is imported: a process of its own); with the
    running torch's clamp convention at the bounds, and with the other one (torch 2.11 passes the gradient there)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    script = ("from tests.test_models_gating import mismatches; from rptrain.models.gating import clamp_passes_at_bound; "
              "other = tuple(not b for b in clamp_passes_at_bound()); print(repr(mismatches('cpu') + mismatches('cpu', other)))")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


def test_without_cuda_the_eager_formula_runs():
    gate_up, _ = inputs(5, 6, torch.float32, "clamped_swiglu", "cpu")
    got = gated_activation(gate_up, "clamped_swiglu", ALPHA, LIMIT)
    assert torch.equal(got, eager(gate_up, "clamped_swiglu", ALPHA, LIMIT))


@pytest.mark.cuda
def test_kernels_match_the_eager_formula_on_a_gpu_and_in_a_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    assert mismatches("cuda") == []
    for activation in ("silu", "clamped_swiglu"):
        for rows in (0, 37):  # recorded in a CUDA graph, then replayed on new values: as the engine's last stage
            gate_up, grad = inputs(rows, 48, torch.bfloat16, activation, "cuda")
            x = gate_up.clone().requires_grad_()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # compiled and warmed before the recording
                torch.autograd.grad(gated_activation(x, activation, ALPHA, LIMIT), x, grad)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = gated_activation(x, activation, ALPHA, LIMIT)
                (dx,) = torch.autograd.grad(out, x, grad)
            with torch.no_grad():
                x.mul_(-0.5)
            graph.replay()
            want = reference(x, grad, activation)
            assert excess(out, want[0], "cuda") <= 0 and excess(dx, want[1], "cuda") <= 0, activation
