"""The MoE combine (rptrain/models/combine.py): its Triton kernels against the eager formula, forward and both
gradients, on the CPU under Triton's interpreter and on a GPU (also recorded in a CUDA graph)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rptrain.models.combine import combine, eager, fused, fused_sum, sum_rows

ROOT = Path(__file__).resolve().parent.parent


def inputs(tokens: int, k: int, D: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Expert outputs in expert order, routing weights, the sort of (token, choice) pairs by expert and its inverse,
    and an output gradient."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(tokens)]) if tokens else torch.zeros(0, k, dtype=torch.long)
    order = experts.flatten().argsort(stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    y = torch.randn(tokens * k, D, generator=g).to(dtype)
    weights = torch.rand(tokens, k, generator=g).softmax(-1)
    grad = torch.randn(tokens, D, generator=g).to(dtype)
    return [t.to(device) for t in (y, weights, order, inverse, grad)]


def results(fn, y, weights, order, inverse, grad):
    y, weights = y.clone().requires_grad_(), weights.clone().requires_grad_()
    out = fn(y, weights, order, inverse)
    out.backward(grad)
    return out, y.grad, weights.grad


def mismatches(device: str) -> list:
    """Shapes and dtypes where the kernels differ from the formula computed in fp32 by more than the dtype's
    rounding (fp32: 1e-5 relative; bf16: 2^-7 of the reference's largest value)."""
    bad = []
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, k, D in ((0, 4, 48), (1, 1, 48), (37, 4, 48), (9, 8, 1100)):
            y, weights, order, inverse, grad = inputs(tokens, k, D, dtype, device)
            want = results(eager, y.float(), weights, order, inverse, grad.float())
            got = results(fused, y, weights, order, inverse, grad)
            for name, a, b in zip(("output", "rows' gradient", "weights' gradient"), got, want):
                assert a.shape == b.shape and a.dtype == (torch.float32 if name.startswith("weights") else dtype)
                tol = 1e-5 if dtype == torch.float32 else 2**-7
                scale = max(b.abs().max().item(), 1.0) if b.numel() else 1.0
                error = (a.float() - b).abs().max().item() if b.numel() else 0.0
                if error > tol * scale:
                    bad.append((f"{dtype} tokens={tokens} k={k} D={D} {name}", error))
            # the dispatch's backward: each token's k rows summed
            summed = fused_sum(y, inverse, k)
            want = y.float().index_select(0, inverse).view(tokens, k, D).sum(1)
            assert summed.dtype == dtype and summed.shape == want.shape
            if summed.numel() and (summed.float() - want).abs().max().item() > (1e-5 if dtype == torch.float32 else 2**-7) * max(want.abs().max().item(), 1.0):
                bad.append((f"{dtype} tokens={tokens} k={k} D={D} sum_rows", (summed.float() - want).abs().max().item()))
    return bad


def test_kernels_match_the_formula_in_the_interpreter():
    """On the CPU under Triton's interpreter (set before triton is imported: a process of its own)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    script = "from tests.test_models_combine import mismatches; print(repr(mismatches('cpu')))"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


def test_without_cuda_the_formula_runs():
    y, weights, order, inverse, _ = inputs(5, 2, 8, torch.float32, "cpu")
    assert torch.equal(sum_rows(y, inverse, 2), y.index_select(0, inverse).view(5, 2, 8).sum(1))
    assert torch.equal(combine(y, weights, order, inverse), eager(y, weights, order, inverse))
    # the formula itself: token t's row is the weighted sum of its k rows in expert order
    want = torch.stack([sum(weights[t, j] * y[inverse[t * 2 + j]] for j in range(2)) for t in range(5)])
    torch.testing.assert_close(combine(y, weights, order, inverse), want)


@pytest.mark.cuda
def test_kernels_match_the_formula_on_a_gpu_and_in_a_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    assert mismatches("cuda") == []
    y, weights, order, inverse, grad = inputs(37, 8, 1100, torch.bfloat16, "cuda")
    x, w = y.clone().requires_grad_(), weights.clone().requires_grad_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiled and warmed before the recording
        torch.autograd.grad(combine(x, w, order, inverse), (x, w), grad)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = combine(x, w, order, inverse)
        dx, dw = torch.autograd.grad(out, (x, w), grad)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    want = results(fused, x.detach(), weights, order, inverse, grad)
    for a, b in zip((out, dx, dw), want):
        assert torch.equal(a, b)
