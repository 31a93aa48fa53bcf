"""Plain-PyTorch references the engine is compared against.

``Reference`` trains a compute copy (the model's dtype) whose gradients feed an fp32 master copy
with ``torch.optim.Adam`` — the same math the engine does, written the obvious way. Microbatches
run one after another with gradients accumulating in the compute copy, so BatchNorm sees the same
microbatches as in the engine. With ``delayed=True`` the compute copy trails the master by one
step: the gradient of iteration k is taken at the weights after max(k-1, 0) steps.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Optional

import torch
from torch import nn

from rptrain.engine.batching import map_tensors, split_sizes

# The engine runs on the GPU when there is one; the reference's compute copy runs there too.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def where_engine_steps(engine) -> str:
    """The device type of the engine's optimizer step: its GPU share steps with CUDA's fused Adam, whose
    rounding differs from the CPU kernel's in near-zero gradients (Adam turns them into lr-sized
    steps: 2.4e-6 apart on a tiny Llama's embedding after three steps at lr 1e-2)."""
    placement = engine.placement
    return engine.devices[0].type if placement is not None and placement.params_on("gpu") else "cpu"


def split(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(torch.split(t, split_sizes(t.shape[0], n)))


def ran_as_one_batch(engine) -> bool:
    """Whether the engine's newest training call ran its microbatches as one batch (engine/fused_call.py on
    the stage path, engine/fusion.py inside a whole call): the reference then does the same."""
    joined = engine._fusion.joined
    return joined if joined is not None else any(g.joined for g in engine._executor._whole.values())


@contextlib.contextmanager
def batch_norm_per_slice(model: nn.Module, sizes: list[int]):
    """Inside: each training-mode BatchNorm of ``model`` normalises each slice of its input by itself, in
    order (its running statistics updated once per slice), as when the slices run one after another."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    for bn in norms:
        bn.forward = lambda x, bn=bn: torch.cat([type(bn).forward(bn, part) for part in x.split(sizes)])
    try:
        yield
    finally:
        for bn in norms:
            del bn.forward


class Reference:
    def __init__(self, model: nn.Module, lr: float = 1e-2, delayed: bool = False, betas=(0.9, 0.999), weight_decay: float = 0.0, device: str = DEVICE,
                 master_device: str = "cpu"):
        self.device = device
        self.master_device = master_device  # where_engine_steps(engine): the fused kernels of CPU and CUDA round apart
        self.compute = copy.deepcopy(model).to(device)
        self.master = copy.deepcopy(model).float().to(master_device)
        # torch's fused kernel, as in rptrain.optim.Adam: elementwise the same rounding.
        self.opt = torch.optim.Adam(self.master.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, fused=True)
        self.delayed = delayed

    def forward_backward(self, x: Any, y: torch.Tensor, n: int, loss_fn: Callable, call: Optional[Callable] = None,
                         fused: bool = False) -> float:
        """Accumulate gradients of one batch in ``n`` microbatches; returns the summed loss. ``fused``: the
        microbatches as one batch, BatchNorm per microbatch slice, each microbatch's loss on its slice of
        the outputs and one backward for all (what the engine does on one GPU: engine/fused_call.py)."""
        call = call or (lambda model, xm: model(xm))
        x, y = map_tensors(lambda t: t.to(self.device), (x, y))
        if fused:
            sizes = split_sizes(x.shape[0], n)
            with batch_norm_per_slice(self.compute, sizes):
                out = call(self.compute, x)
            losses = [loss_fn(o, ym) for o, ym in zip(out.split(sizes), split(y, n))]
            torch.autograd.backward(losses)
            return sum(loss.item() for loss in losses)
        xs = split(x, n) if isinstance(x, torch.Tensor) else x
        total = 0.0
        for xm, ym in zip(xs, split(y, n)):
            loss = loss_fn(call(self.compute, xm), ym)
            loss.backward()
            total += loss.item()
        return total

    def step(self, before: Optional[Callable] = None) -> None:
        """Move the accumulated gradients to the master copy, step, and refresh the compute copy."""
        for pm, pc in zip(self.master.parameters(), self.compute.parameters()):
            pm.grad = None if pc.grad is None else pc.grad.float().to(self.master_device)
            pc.grad = None
        previous = [p.detach().clone() for p in self.master.parameters()]
        if before is not None:
            before(self.opt)
        self.opt.step()
        self.opt.zero_grad()
        source = previous if self.delayed else [p.detach() for p in self.master.parameters()]
        with torch.no_grad():
            for pc, value in zip(self.compute.parameters(), source):
                pc.copy_(value)

    def state(self) -> dict:
        """Master parameters and compute-copy buffers, keyed like ``RoundPipe.state_dict()``."""
        out = {}
        master = dict(self.master.named_parameters(remove_duplicate=False))
        for name, t in self.compute.state_dict(keep_vars=True).items():
            out[name] = (master[name] if name in master else t).detach().cpu()
        return out


def assert_state_close(actual: dict, expected: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        a, e = actual[name], expected[name]
        assert a.dtype == e.dtype or a.is_floating_point(), name
        torch.testing.assert_close(a.to(e.dtype), e, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def engine_gradients(model: nn.Module, batch: Any, run_config: Any) -> list[torch.Tensor]:
    """The master gradients of one engine call on ``batch`` (the model returns its loss), in
    parameter order: the engine side of a gradient comparison against plain autograd."""
    from rptrain import OptimizerCtx, RoundPipe

    engine = RoundPipe(model)
    with OptimizerCtx():
        masters = list(engine.parameters())
        opt = torch.optim.SGD(masters, lr=0.0)
    grads: list[torch.Tensor] = []
    engine.forward_backward(input_args=(batch,), loss_fn=lambda out, _: out, run_config=run_config)
    engine.step(lambda: (grads.extend(p.grad.cpu().clone() for p in masters), opt.zero_grad()), is_async=False)  # on the GPU for its share
    engine.close()
    return grads

