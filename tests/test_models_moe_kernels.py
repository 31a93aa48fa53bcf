"""The grouped GEMM of the experts: torch._grouped_mm and the padded-bmm fallback both equal one matmul per
group (forward and gradients, fp32), experts with no tokens included; the fallback takes what the kernel refuses."""
from __future__ import annotations

import pytest
import torch

from rptrain.models import experts
from rptrain.models.experts import _grouped_mm_runs, grouped_mm


def reference(x, w, counts):
    return torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(zip([0, *counts.cumsum(0).tolist()], counts.cumsum(0).tolist()))])


# 12 x 4 bytes is no multiple of 16: the fallback; static: padded to the bound, as while a CUDA graph records
@pytest.mark.parametrize("K, N, kernel, static", [(16, 8, True, False), (12, 6, False, False), (12, 6, False, True)])
def test_grouped_mm_equals_a_matmul_per_group(monkeypatch, K, N, kernel, static):
    monkeypatch.setattr(experts, "_shapes_must_be_static", lambda x: static)
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2])  # expert 1 gets nothing
    x = torch.randn(int(counts.sum()), K, generator=g, requires_grad=True)
    w = torch.randn(4, K, N, generator=g, requires_grad=True)
    group = torch.repeat_interleave(torch.arange(4), counts)
    assert _grouped_mm_runs(x, w) == kernel
    out = grouped_mm(x, w, counts.cumsum(0).to(torch.int32), group, max_rows=7)
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
    out = grouped_mm(x, w, counts.cumsum(0).to(torch.int32), torch.repeat_interleave(torch.arange(2), counts), max_rows=6)
    torch.testing.assert_close(out, reference(x, w, counts))


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_moe_block_never_reads_the_device(tmp_path, name):
    """A MoE decoder block's forward and backward on the meta device, where the grouped GEMM falls back to the padded
    bmm: a read of a device value (.item(), bincount's size, nonzero) or a host tensor mixed in fails there, as it
    fails a CUDA graph's recording ("Cannot copy between CPU and CUDA tensors during CUDA graph capture")."""
    import json

    from rptrain.models.decoder import DecoderBlock
    from rptrain.models.hf_config import decoder_config
    from test_models_hf_moe import save_moe

    save_moe(name, tmp_path)
    block = DecoderBlock(decoder_config(json.loads((tmp_path / "config.json").read_text())), 0, device="meta")
    h = torch.empty(2, 12, 32, device="meta", requires_grad=True)
    out, _, stats = block((h, None, torch.zeros(2, 4, device="meta")))
    (out.sum() + stats.sum()).backward()
    assert h.grad.shape == h.shape and all(p.grad is not None for p in block.mlp.parameters() if p.requires_grad)
