"""The grouped GEMM of the experts: torch._grouped_mm and the padded-bmm fallback both equal one matmul per
group (forward and gradients, fp32), experts with no tokens included; the fallback takes what the kernel refuses."""
from __future__ import annotations

import pytest
import torch

from rptrain.models import experts
from rptrain.models.experts import _grouped_mm_runs, grouped_mm


def reference(x, w, counts):
    return torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(zip([0, *counts.cumsum(0).tolist()], counts.cumsum(0).tolist()))])


@pytest.mark.parametrize("K, N, kernel", [(16, 8, True), (12, 6, False)])  # 12 x 4 bytes is no multiple of 16: the fallback
def test_grouped_mm_equals_a_matmul_per_group(K, N, kernel):
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2])  # expert 1 gets nothing
    x = torch.randn(int(counts.sum()), K, generator=g, requires_grad=True)
    w = torch.randn(4, K, N, generator=g, requires_grad=True)
    group = torch.repeat_interleave(torch.arange(4), counts)
    assert _grouped_mm_runs(x, w) == kernel
    out = grouped_mm(x, w, counts.cumsum(0).to(torch.int32), group)
    grad = torch.randn(out.shape, generator=g)
    (out * grad).sum().backward()
    got = out.detach(), x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    want = reference(x, w, counts)
    (want * grad).sum().backward()
    for a, b in zip(got, (want.detach(), x.grad, w.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fallback_when_the_kernel_is_missing(monkeypatch):
    monkeypatch.setattr(experts, "_HAS_GROUPED_MM", False)  # torch before _grouped_mm
    x, w = torch.randn(6, 16), torch.randn(2, 16, 8)
    assert not _grouped_mm_runs(x, w)
    counts = torch.tensor([4, 2])
    out = grouped_mm(x, w, counts.cumsum(0).to(torch.int32), torch.repeat_interleave(torch.arange(2), counts))
    torch.testing.assert_close(out, reference(x, w, counts))
