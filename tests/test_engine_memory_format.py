"""RoundPipe(memory_format=torch.channels_last) against plain PyTorch (contiguous), on the CPU and,
through `device`, CUDA (there with CUDA graphs): same losses, weights, BatchNorm statistics and
evaluation outputs, fp32 tolerances as test_engine_equivalence (rtol 1e-5). The weights are stored
channels-last as ``model.to(memory_format=torch.channels_last)`` stores them in plain PyTorch: the
master weights, their gradients and the optimizer's moments share that layout, and the optimizer's
flat path still covers every parameter."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from reference import Reference, assert_state_close
from rptrain import ExecutePlan, RoundPipe, RoundPipeRunConfig
from rptrain.optim.flat import _FlatRuns
from rptrain.engine.memory_format import check_memory_format, convert_inputs, has_convolutions
from test_engine_equivalence import convnet, image_batches, make_engine

SEEN: list[bool] = []  # whether the first layer's input was channels-last, per call


class Probe(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
        return x


def probed_convnet() -> nn.Sequential:
    return nn.Sequential(Probe(), *convnet())


def channels_last(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x.contiguous(memory_format=torch.channels_last))


@pytest.mark.parametrize("plan", [None, ExecutePlan.from_cuts(11, forward=[4, 7], backward=[3, 7])], ids=["auto", "stages"])
@pytest.mark.parametrize("delayed", [False, True], ids=["sync", "async"])
def test_channels_last_trains_like_plain_pytorch(plan, delayed):
    """Every step's gradients and loss, then weights and statistics, against plain PyTorch fed
    channels-last inputs (the same kernels); the first step's gradients also against plain
    PyTorch in the standard layout (later steps are not compared with it: Adam turns rounding
    differences of near-zero gradients into lr-sized steps)."""
    SEEN.clear()
    model, loss_fn = probed_convnet(), nn.CrossEntropyLoss()
    engine, opt = make_engine(model, memory_format=torch.channels_last)
    ref, standard = Reference(model, delayed=delayed), Reference(model, delayed=delayed)
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    for i, (x, y) in enumerate(image_batches()):
        grads = []

        def step():
            grads.extend(p.grad.cpu().clone() for p in engine._host.master_params)  # on the GPU for its share
            for p in engine._host.master_params:
                assert p.grad.stride() == p.stride()
                assert p.is_contiguous(memory_format=torch.channels_last) if p.dim() == 4 else p.is_contiguous()
            runs = _FlatRuns._find_runs(list(engine._host.master_params))
            assert sum(map(len, runs)) == len(engine._host.master_params)  # the fused flat path covers conv weights too
            opt.step()
            opt.zero_grad()

        loss = engine.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, run_config=cfg)
        engine.step(step, is_async=delayed)
        assert loss.item() == pytest.approx(ref.forward_backward(x, y, 2, loss_fn, call=channels_last), rel=1e-5, abs=1e-6)
        references = [ref] if i else [ref, standard]
        if not i:
            standard.forward_backward(x, y, 2, loss_fn)
        for r in references:
            for g, p in zip(grads, r.compute.parameters()):
                torch.testing.assert_close(g, p.grad.float().cpu(), rtol=1e-5, atol=1e-6)
        ref.step()
    engine.synchronize()
    # Only the standard reference's 2 microbatches ran contiguous: the channels-last reference's 8 and
    # every engine forward that ran Python did not (on CUDA a replayed graph runs none: at least the
    # recording's; on the CPU all 4 batches x 2 microbatches, recomputes too).
    engine_calls = SEEN.count(True) - 8
    assert SEEN.count(False) == 2 and engine_calls >= (1 if torch.cuda.is_available() else 8)
    state = engine.state_dict()
    assert_state_close(state, ref.state())
    assert all(t.is_contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t.is_contiguous() for t in state.values())
    for p in engine._host.master_params:
        assert opt.state[p]["exp_avg"].stride() == p.stride()
    if not delayed:  # (the delayed reference's compute copy trails the synchronized engine by a step)
        x = torch.randn(5, 3, 8, 8)
        engine.eval()
        ref.compute.eval()
        with torch.no_grad():
            torch.testing.assert_close(engine(x), ref.compute(x.to(ref.device)).cpu(), rtol=1e-5, atol=1e-6)
    engine.close()


def test_helpers():
    assert check_memory_format(torch.contiguous_format) is None and check_memory_format(torch.channels_last) is torch.channels_last
    with pytest.raises(ValueError, match="memory_format"):
        RoundPipe(convnet(), memory_format=torch.channels_last_3d)
    x, ids = torch.randn(2, 3, 4, 4), torch.zeros(2, 3, 4, 4, dtype=torch.long)
    out = convert_inputs({"x": x, "ids": ids, "v": torch.randn(2, 3)}, torch.channels_last)
    assert out["x"].is_contiguous(memory_format=torch.channels_last) and torch.equal(out["x"], x)
    assert out["ids"] is ids  # integer tensors and other ranks pass through
    assert has_convolutions(convnet()) and not has_convolutions(nn.Sequential(nn.Linear(2, 2)))


def test_channels_last_with_autograd_backward():
    """``loss = f(model(x)); loss.backward()`` through stages: the input's gradient (what the user
    sees, in its own layout) and the parameters' against plain PyTorch, rtol 1e-5."""
    engine, opt = make_engine(convnet(), memory_format=torch.channels_last)
    ref = Reference(convnet(), device="cpu")
    # One microbatch: BatchNorm then sees the batch the reference sees.
    cfg = RoundPipeRunConfig(num_microbatch=1, execute_plan=ExecutePlan.from_cuts(10, forward=[3, 6], backward=[2, 6]))
    grads = []
    for x, y in image_batches(count=2):
        x1 = x.clone().requires_grad_(True)
        loss = nn.functional.cross_entropy(engine(x1, run_config=cfg), y, reduction="sum")
        loss.backward()
        engine.step(lambda: (grads.extend(p.grad.cpu().clone() for p in engine._host.master_params), opt.step(), opt.zero_grad()), is_async=False)
        x2 = x.clone().requires_grad_(True)
        ref_loss = nn.functional.cross_entropy(channels_last(ref.compute, x2), y, reduction="sum")
        ref_loss.backward()
        expected = [p.grad.clone() for p in ref.compute.parameters()]
        ref.step()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
        assert x1.grad.shape == x.shape
        for g, e in zip(grads[-len(expected):], expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    engine.close()
