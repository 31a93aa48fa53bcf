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


SMALL = {"qwen3_30b_a3b": dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
         "gpt_oss_20b": dict(hidden_size=64, intermediate_size=32, num_experts=8, num_experts_per_tok=2)}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # the grouped kernel (capability 9+) and the fallback
@pytest.mark.parametrize("name", sorted(SMALL))  # Qwen3's transposed expert views, GPT-OSS's interleaved ones with biases
def test_moe_layer_records_as_a_cuda_graph(name, dtype):
    """A MoE layer's forward and backward record as one CUDA graph (no read of the device while recording), and
    a replay on other tokens gives what an eager run gives (rtol 1e-2 in bf16, 1e-5 in fp32)."""
    from rptrain.models.hf_presets import qwen3_config
    from rptrain.models.moe import SparseMoe

    cfg = qwen3_config(name, **SMALL[name])
    torch.manual_seed(0)
    moe = SparseMoe(cfg.moe, cfg.hidden_size, device="cuda", dtype=dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    x, stats = torch.randn(3, 16, 64, device="cuda", dtype=dtype), torch.zeros(2, 8, device="cuda")

    def step():
        out, new_stats = moe(x, stats)
        (out.float().square().sum() + new_stats.sum()).backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    moe.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorded = step()
    x.copy_(torch.randn(x.shape, device="cuda", dtype=dtype))
    for p in moe.parameters():
        p.grad.zero_()
    graph.replay()
    replayed = [recorded.clone()] + [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad(set_to_none=True)
    eager = [step().detach()] + [p.grad for p in moe.parameters()]
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(replayed, eager):
        torch.testing.assert_close(a, b, **tol)


def test_balance_records_average_since_the_last_take():
    from rptrain.models.moe import record_balance, take_balance

    take_balance()
    assert take_balance() is None
    for value in (1.0, 2.0, 6.0):
        record_balance(torch.tensor(value))
    assert take_balance() == 3.0 and take_balance() is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_balance_records_count_cuda_graph_replays():
    """A forward replayed as a CUDA graph records its load-balancing loss at every replay (the engine graphs small
    fused stages, MoE ones included, since their routing reads nothing from the device)."""
    from rptrain.models.moe import record_balance, take_balance

    aux = torch.ones((), device="cuda")
    record_balance(aux)  # eager first, as the engine's warm-up runs are
    take_balance()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        record_balance(aux * 2)
    for value in (1.0, 4.0):
        aux.fill_(value)
        graph.replay()
    assert take_balance() == 5.0  # (2 + 8) / 2


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_experts_forward_and_gradients_equal_a_loop_over_tokens(gpt_oss):
    """The sorted, grouped layer (dispatch, per-expert bias, weighted combine, each with its own backward)
    against each token's k experts applied one by one, in float64: output and every gradient (x, the
    routing weights, weights and biases) to 1e-10."""
    from rptrain.models.decoder_config import MoeConfig
    from rptrain.models.experts import Experts

    moe = MoeConfig(n_experts=5, top_k=2, expert_size=6, layers=(True,), bias=gpt_oss, interleaved=gpt_oss,
                    activation="clamped_swiglu" if gpt_oss else "silu")
    torch.manual_seed(0)
    layer = Experts(moe, 4, dtype=torch.float64)
    for p in layer.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    chosen = torch.stack([torch.randperm(5)[:2] for _ in range(7)])
    chosen[:, 0] = torch.tensor([0, 0, 0, 2, 2, 4, 1])  # expert 3 gets no rows unless randperm picks it
    weights = torch.rand(7, 2, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(7, 4, dtype=torch.float64)

    def one(t: int, e: int) -> torch.Tensor:
        w_gate_up = layer.gate_up_proj[e] if gpt_oss else layer.gate_up_proj[e].T
        h = x[t] @ w_gate_up + (layer.gate_up_proj_bias[e] if gpt_oss else 0)
        w_down = layer.down_proj[e] if gpt_oss else layer.down_proj[e].T
        return layer._gated(h) @ w_down + (layer.down_proj_bias[e] if gpt_oss else 0)

    def grads(out):
        (out * grad).sum().backward()
        got = [out.detach(), x.grad.clone(), weights.grad.clone(), *(p.grad.clone() for p in layer.parameters())]
        x.grad = weights.grad = None
        layer.zero_grad(set_to_none=True)
        return got

    got = grads(layer(x, chosen, weights))
    want = grads(torch.stack([sum(weights[t, j] * one(t, int(chosen[t, j])) for j in range(2)) for t in range(7)]))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
