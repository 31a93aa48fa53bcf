"""The original RoundPipe library's documented API on rptrain (issue 19), each against plain PyTorch.

Like tests/test_engine_equivalence.py: the engine takes every GPU when there is one (else the
CPU) and the reference runs on the same device. Tolerance: fp32 rtol 1e-5 / atol 1e-6 (microbatch
sums and kernel choices differ only in rounding).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._pytree import register_pytree_node

from reference import Reference, assert_state_close
from rptrain import ExecutePlan, OptimizerCtx, RoundPipe, RoundPipeRunConfig
from rptrain.optim import Adam
from test_engine_equivalence import make_engine, mlp, vector_batches

CE = nn.CrossEntropyLoss()
TOL = dict(rtol=1e-5, atol=1e-6)
PLAN_7 = ExecutePlan.from_cuts(7, [2, 5], [1, 3, 5])


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.cpu(), b.detach().cpu(), **TOL)


@pytest.mark.parametrize("plan", [ExecutePlan.single_stage(7), PLAN_7], ids=["single", "multi"])
def test_plain_backward_accumulates_like_pytorch(plan):
    """``criterion(model(x), y).backward()`` with inputs that need no grad, two calls before each
    step; ``synchronize()`` shows the accumulated gradients as the wrapped model's ``.grad``."""
    engine, opt = make_engine(mlp())
    ref = Reference(mlp())
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    batches = vector_batches(count=4)
    for first, second in zip(batches[::2], batches[1::2]):
        for x, y in (first, second):
            loss = CE(engine(x, run_config=cfg), y)
            loss.backward()
            expected = CE(ref.compute(x.to(ref.device)), y.to(ref.device))
            expected.backward()
            assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
        engine.synchronize()
        for (name, p), q in zip(engine.model.named_parameters(), ref.compute.parameters()):
            assert p.grad is not None, name
            close(p.grad, q.grad)
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        ref.step()
    engine.synchronize()
    assert all(p.grad is None for p in engine.model.parameters())  # the step took them
    assert_state_close(engine.state_dict(), ref.state())


class Pair:
    """A user's type, registered as a pytree node, passed between layers."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        self.a, self.b = a, b


register_pytree_node(Pair, lambda p: ([p.a, p.b], None), lambda children, _: Pair(*children))


class Unregistered:
    def __init__(self, a: torch.Tensor):
        self.a = a


class ToPair(nn.Module):
    def __init__(self, wrap=Pair):
        super().__init__()
        self.lin, self.wrap = nn.Linear(8, 8), wrap

    def forward(self, x):
        h = self.lin(x)
        return self.wrap(h, torch.tanh(h)) if self.wrap is Pair else self.wrap(h)


class FromPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, p):
        return self.lin(p.a * p.b if isinstance(p, Pair) else p.a)


def pair_model(wrap=Pair) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), ToPair(wrap), FromPair())


def test_registered_pytree_type_between_stages_carries_gradients():
    engine, opt = make_engine(pair_model())
    ref = Reference(pair_model())
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=ExecutePlan.per_layer(3))
    for x, y in vector_batches(count=3):
        loss = engine.forward_backward((x,), label=y, loss_fn=CE, run_config=cfg)
        engine.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        assert loss.item() == pytest.approx(ref.forward_backward(x, y, 2, CE), rel=1e-5)
        ref.step()
    engine.synchronize()
    assert_state_close(engine.state_dict(), ref.state())
    assert not torch.equal(engine.state_dict()["0.weight"], pair_model()[0].weight)  # the first layer trained


def test_unregistered_type_between_stages_raises_naming_it():
    engine, _ = make_engine(pair_model(Unregistered))
    x, y = vector_batches(count=1)[0]
    cfg = RoundPipeRunConfig(num_microbatch=1, execute_plan=ExecutePlan.per_layer(3))
    with pytest.raises(TypeError, match="Unregistered.*register_pytree_node"):
        engine.forward_backward((x,), label=y, loss_fn=CE, run_config=cfg)
