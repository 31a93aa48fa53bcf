"""model.fused: the decoder with its elementwise work compiled (rptrain.models.fused) computes what the
eager decoder computes, alone and through the engine.

Tolerance: fp32, rtol 1e-5; gradients also within 1e-5 of their tensor's largest entry (atol), since
an element near zero has no relative precision. Compiled kernels sum the RMSNorm mean of squares, the
loss's log-sum-exp and the weights' gradient reductions in another order than eager PyTorch and keep
float32 intermediates in registers: the results differ in the last bits (measured: at most 1.3e-6 of a
tensor's largest gradient, 0 to 1e-7 relative in the loss), not in the math. Inductor compiles C++ on the CPU, so
the cases are few and tiny; the compiled kernels are shared by the tests in this process.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from reference import Reference, assert_state_close, where_engine_steps
from rptrain import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from rptrain.models import build_model, count_tokens
from rptrain.models.decoder import build_decoder
from rptrain.models.hf_presets import qwen3_config
from rptrain.optim import Adam

# Qwen3's layer structure (q/k norms, tied head) in llama_tiny's sizes and eps: the compiled kernels
# the two share (norms, SwiGLU, the loss) are compiled once.
TINY_QWEN3 = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=512, rms_norm_eps=1e-5, loss_chunk_tokens=16)


def tiny(family: str, fused: bool) -> torch.nn.Sequential:
    """The same weights whether fused or not (the switch changes no parameter or init)."""
    torch.manual_seed(0)
    if family == "llama":
        return build_model("llama_tiny", loss_chunk_tokens=16, fused=fused)
    if family == "qwen3":
        return build_model("qwen3_0_6b", fused=fused, **TINY_QWEN3)
    # Gemma-2/3's switches on the Qwen3 shape: (1 + w) norms, GeGLU, sandwich norms, soft-capped logits.
    cfg = dataclasses.replace(qwen3_config("qwen3_0_6b", **TINY_QWEN3), norm_offset=True, activation="gelu_tanh",
                              sandwich_norms=True, final_softcap=30.0, embed_scale=8.0, fused=fused)
    return build_decoder(cfg)


def loss_and_grads(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(batch)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def token_batch(batch: int = 2, seq: int = 24, packed: bool = False) -> tuple:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 500, (batch, seq + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    y[0, :5] = -100  # ignored targets: the loss's mask
    if not packed:
        return x, y
    segments = torch.zeros_like(x)
    segments[0, seq // 3:] = 1  # two documents in the first row: rotary positions restart
    return x, y, segments


def assert_fused_matches_eager(family: str, packed: bool, device: str) -> None:
    batch = tuple(t.to(device) for t in token_batch(packed=packed))
    want, want_grads = loss_and_grads(tiny(family, fused=False).to(device), batch)
    got, got_grads = loss_and_grads(tiny(family, fused=True).to(device), batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("family, packed", [("llama", False), ("qwen3", True)])
def test_fused_decoder_matches_eager(family, packed):
    """Forward loss and every parameter's gradient; qwen3 with packed rows (per-row rotary positions)."""
    assert_fused_matches_eager(family, packed, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels need a GPU")
@pytest.mark.parametrize("family, packed", [("llama", False), ("qwen3", True), ("gemma-like", False), ("gemma-like", True)])
def test_fused_decoder_matches_eager_on_cuda(family, packed):
    """The same with inductor's Triton kernels (the CPU runs its C++ ones), and Gemma's switches: (1 + w)
    norms, GeGLU, sandwich norms, soft-capped logits (10 s more of C++ compiling on 2 CPU cores)."""
    assert_fused_matches_eager(family, packed, "cuda")


@pytest.mark.slow
def test_fused_llama_trains_through_the_engine_like_eager_pytorch():
    """Three synchronous steps of the fused tiny Llama through RoundPipe (two microbatches: the engine's
    shells rebind the weights the compiled kernels receive, and it recomputes under no_grad and with grad).

    Against plain PyTorch on the same fused model: the state after the steps within the engine tests'
    tolerance. Against the eager (unfused) model: every step's loss within rel 1e-5. The states are not
    compared there: Adam moves a weight by about lr whatever its gradient's size, so last-bit differences
    in near-zero gradients become weight differences near lr (8e-6 seen at lr 1e-2, as in reference.py)."""
    engine = RoundPipe(tiny("llama", fused=True))
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)
    refs = [Reference(tiny("llama", fused=fused), lr=1e-2, device=engine.devices[0].type, master_device=where_engine_steps(engine))
            for fused in (True, False)]
    cfg = RoundPipeRunConfig(num_microbatch=2)
    for step in range(3):
        x, y = token_batch(batch=4)  # microbatches of token_batch()'s shape: the kernels compiled above
        x = (x + step) % 500
        n = count_tokens(y)
        loss = engine.forward_backward(input_args=((x, y),), loss_fn=lambda out, _: out / n, run_config=cfg)
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        for ref in refs:
            expected = 0.0
            for xm, ym in zip(x.chunk(2), y.chunk(2)):
                part = ref.compute((xm.to(ref.device), ym.to(ref.device))) / n
                part.backward()
                expected += part.item()
            ref.step()
            assert loss.item() == pytest.approx(expected, rel=1e-5)
    engine.synchronize()
    assert_state_close(engine.state_dict(), refs[0].state(), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_fused_llama_replays_in_cuda_graphs_like_pytorch():
    """The resident fused stage records the compiled kernels into CUDA graphs and replays them (rebound
    weights, static inputs), training as plain PyTorch does on the same fused model."""
    model = tiny("llama", fused=True)
    engine = RoundPipe(copy.deepcopy(model), cuda_graphs=True)
    with OptimizerCtx():
        opt = Adam(engine.parameters(), lr=1e-2)
    ref = Reference(model, lr=1e-2, device="cuda", master_device=where_engine_steps(engine))
    for step in range(4):  # the first call measures, the second records, the rest replay
        x, y = token_batch(batch=2)
        x = (x + step) % 500
        n = count_tokens(y)
        loss = engine.forward_backward(input_args=((x, y),), loss_fn=lambda out, _: out / n, run_config=RoundPipeRunConfig(num_microbatch=1))
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        expected = ref.compute((x.cuda(), y.cuda())) / n
        expected.backward()
        ref.step()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    engine.synchronize()
    assert_state_close(engine.state_dict(), ref.state(), rtol=1e-5, atol=1e-6)
    graphs = [rec for g in engine._executor._graphs.values() for rec in g._graphs.values() if rec is not None]
    graphs += [rec for g in engine._executor._whole.values() for rec in g._recorded.values() if rec is not None]  # one stage: the whole call's
    assert graphs, "the fused stage ran eagerly: its CUDA graph capture failed (see the warning)"
