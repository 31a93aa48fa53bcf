"""Host memory: master weights, two compute copies, buffers and two gradient buffers.

- ``master``: one flat tensor in ``optim_dtype`` holding every parameter; the optimizer owns views of it.
- ``compute[v % 2]``: version ``v`` of the weights in the model's dtype, one flat tensor per dtype
  (pinned when a GPU reads it). Two copies let the optimizer write version v+1 while a call reads v.
- ``buffers``: BatchNorm statistics and other buffers, one flat tensor per dtype, updated in place.
- ``grads[w]``: two flat fp32 gradient buffers in the master's layout. A call accumulates into the
  open window's buffer while the optimizer may still read the other one.
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch
from torch import Tensor, nn

from .layout import FlatLayout, Range


class GradBuffer:
    """One fp32 gradient buffer and which slots of it hold this window's gradients."""

    def __init__(self, layout: FlatLayout, pin_memory: bool):
        self.flat = torch.zeros(layout.total, dtype=torch.float32, pin_memory=pin_memory)
        self.views = [layout.master_view(self.flat, slot) for slot in layout.slots]  # master .grad per slot
        self.written = [False] * len(layout.slots)
        self.free = threading.Event()  # set when nothing (optimizer .grad views) refers to it
        self.free.set()

    def reset(self) -> None:
        self.written = [False] * len(self.written)


class HostState:
    def __init__(self, layers: Sequence[nn.Module], optim_dtype: torch.dtype, pin_memory: bool, pin_master: bool = False):
        for layer in layers:
            for name, p in layer.named_parameters():
                if not p.is_floating_point():
                    raise ValueError(f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters are supported")
        self.layers = layers
        self.pin_memory = pin_memory
        self.params = FlatLayout.of_parameters(layers)
        self.buffer_layout = FlatLayout.of_buffers(layers)
        originals = self._unique_tensors(layers, "parameters")

        self.compute = [self.params.allocate(pin_memory), self.params.allocate(pin_memory)]
        # Pinned when GPUs cast their resident copy from it (refresh.py): DMA reads it directly.
        self.master = torch.zeros(self.params.total, dtype=optim_dtype, pin_memory=pin_master)
        with torch.no_grad():
            for slot, p in zip(self.params.slots, originals):
                self.params.view(self.compute[0], slot).copy_(p.detach())
                self.params.master_view(self.master, slot).copy_(p.detach())
        self.master_params = [
            nn.Parameter(self.params.master_view(self.master, slot), requires_grad=slot.requires_grad)
            for slot in self.params.slots
        ]

        self.buffers = self.buffer_layout.allocate(pin_memory)
        with torch.no_grad():
            for slot, b in zip(self.buffer_layout.slots, self._unique_tensors(layers, "buffers")):
                self.buffer_layout.view(self.buffers, slot).copy_(b.detach())
            # The user's modules now look at our storage: their old tensors can be freed.
            for slot, b in zip(self.buffer_layout.slots, self._unique_tensors(layers, "buffers")):
                b.data = self.buffer_layout.view(self.buffers, slot)
        self.user_params = originals
        self.show_version(0)
        self.grads: list[GradBuffer] = [GradBuffer(self.params, pin_memory)]

    @staticmethod
    def _unique_tensors(layers: Sequence[nn.Module], kind: str) -> list[Tensor]:
        seen, out = set(), []
        for layer in layers:
            named = layer.named_parameters(remove_duplicate=False) if kind == "parameters" else layer.named_buffers(remove_duplicate=False)
            for _, t in named:
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return out

    def show_version(self, version: int) -> None:
        """Point the user's model parameters at compute copy ``version``."""
        flats = self.compute[version % 2]
        for slot, p in zip(self.params.slots, self.user_params):
            p.data = self.params.view(flats, slot)

    def grad_buffer(self, index: int) -> GradBuffer:
        while len(self.grads) <= index:  # the second buffer only when training runs asynchronously
            self.grads.append(GradBuffer(self.params, self.pin_memory))
        return self.grads[index]

    def write_compute(self, version: int) -> None:
        """Compute copy ``version`` := master cast to the model's dtype (one pass per dtype)."""
        for key, flat in self.compute[version % 2].items():
            self.write_compute_range(version, Range(key, 0, flat.numel()))

    def write_compute_range(self, version: int, r: Range) -> None:
        """One range of compute copy ``version`` := the master's, cast."""
        self.compute_range(version, r).copy_(self.params.master_range(self.master, r))

    def compute_range(self, version: int, r: Range) -> Tensor:
        return self.compute[version % 2][r.key][r.start : r.stop]

    def buffer_range(self, r: Range) -> Tensor:
        return self.buffers[r.key][r.start : r.stop]
