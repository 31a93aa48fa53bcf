"""Per-device shells of the user's layers: same code and structure, tensors bound on demand.

A shell is a deep copy of a layer whose parameters and buffers are empty placeholders. Before a
job runs, the executor points them at views of the stage's tensors on the job's device (and the
parameters' ``.grad`` at views of a flat gradient buffer, so autograd accumulates in place).
"""
from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from .layout import FlatLayout, Slot


def _placeholder(t: Tensor) -> Tensor:
    empty = torch.empty(0, dtype=t.dtype)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(empty, requires_grad=t.requires_grad)
    return empty


class Shell:
    """One layer's shell for one device."""

    def __init__(self, layer: nn.Module, params: FlatLayout, frozen: FlatLayout, buffers: FlatLayout, index: int):
        memo = {id(t): _placeholder(t) for t in [*layer.parameters(), *layer.buffers()]}
        self.module = copy.deepcopy(layer, memo)
        own_params = dict(self.module.named_parameters(remove_duplicate=False))
        own_buffers = dict(self.module.named_buffers(remove_duplicate=False))
        self.params: list[tuple[nn.Parameter, Slot]] = [
            (own_params[name], params.slots[i]) for name, i in params.layer_slots[index]
        ]
        self.frozen: list[tuple[nn.Parameter, Slot]] = [
            (own_params[name], frozen.slots[i]) for name, i in frozen.layer_slots[index]
        ]
        self.buffers: list[tuple[Tensor, Slot]] = [
            (own_buffers[name], buffers.slots[i]) for name, i in buffers.layer_slots[index]
        ]
        # Walked once: two module walks per bind were 136 named_modules calls a ResNet-34 step (H200 cProfile).
        self._pairs = list(zip(self.module.modules(), layer.modules()))

    def bind(
        self,
        param_view: Callable[[Slot], Tensor],
        frozen_view: Callable[[Slot], Tensor],
        buffer_view: Callable[[Slot], Tensor],
        grad_view: Optional[Callable[[Slot], Tensor]],
    ) -> nn.Module:
        for p, slot in self.params:
            p.data = param_view(slot)
            p.grad = grad_view(slot) if grad_view is not None else None
        for p, slot in self.frozen:  # requires_grad=False: autograd computes no gradient for these
            p.data = frozen_view(slot)
        for b, slot in self.buffers:
            b.data = buffer_view(slot)
        # Mirror train/eval per submodule: users may freeze parts (e.g. BatchNorm in eval mode).
        for mine, theirs in self._pairs:
            mine.training = theirs.training
        return self.module

    def release(self) -> None:
        """Drop references to device memory so it can be reused once the job is done."""
        for p, _ in self.params + self.frozen:
            p.data = torch.empty(0, dtype=p.dtype)
            p.grad = None
        for b, _ in self.buffers:
            b.data = torch.empty(0, dtype=b.dtype)
