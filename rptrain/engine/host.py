"""Host memory: master weights, two compute copies, buffers, two gradient buffers and frozen weights.

- ``master``: one flat tensor in ``optim_dtype`` holding every trainable parameter (``requires_grad``);
  the optimizer owns views of it.
- ``compute[v % 2]``: version ``v`` of the weights in the model's dtype, one flat tensor per dtype
  (pinned when a GPU reads it). Two copies let the optimizer write version v+1 while a call reads v.
- ``buffers``: BatchNorm statistics and other buffers, one flat tensor per dtype, updated in place.
- ``grads[w]``: two flat fp32 gradient buffers in the master's layout. A call accumulates into the
  open window's buffer while the optimizer may still read the other one.
- ``frozen``: parameters with ``requires_grad=False`` (e.g. a LoRA base model), stored once in their own
  dtype, one flat tensor per dtype, read-only: no master, no gradient, no second copy, since nothing
  ever writes them. ``requires_grad`` is read when the engine wraps the model.

Bytes per parameter: trainable = compute dtype x 2 + optim dtype (master) + 4 x 1 or 2 (gradient
buffers; the second only for async steps) + the optimizer's state (Adam: 2 x optim dtype); frozen =
its own dtype x 1.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from .gpushare import GpuShare
from .layout import FlatLayout, Range


def pins_frozen(nbytes: int, pin_share: float) -> bool:
    """Whether frozen weights of ``nbytes`` are pinned on a GPU engine: at most ``pin_share`` of the
    machine's physical memory (fit.py predicts the same)."""
    return nbytes <= pin_share * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class GradBuffer:
    """One fp32 gradient buffer and which slots of it hold this window's gradients: on the host, and
    on the GPU for the GPU share (``gpu``, one tensor per dtype; gpushare.py)."""

    def __init__(self, layout: FlatLayout, pin_memory: bool, share: Optional[GpuShare] = None):
        self.flat = torch.zeros(layout.total, dtype=torch.float32, pin_memory=pin_memory)
        self.gpu = share.allocate(torch.float32) if share is not None else {}
        self.views = [share.view(self.gpu, slot) if share is not None and share.holds(slot) else layout.master_view(self.flat, slot)
                      for slot in layout.slots]  # master .grad per slot
        self.written = [False] * len(layout.slots)
        self.free = threading.Event()  # set when nothing (optimizer .grad views) refers to it
        self.free.set()
        self.held = False  # a failed or partial step left master .grad views into it (roundpipe.py)

    def reset(self) -> None:
        self.written = [False] * len(self.written)

    def owns(self, t: Optional[Tensor]) -> bool:
        """Whether ``t`` is a view of this buffer (host or GPU part)."""
        if t is None:
            return False
        ptr = t.untyped_storage().data_ptr()
        return any(ptr == f.untyped_storage().data_ptr() for f in (self.flat, *self.gpu.values()))


class HostState:
    def __init__(self, layers: Sequence[nn.Module], optim_dtype: torch.dtype, pin_memory: bool, pin_master: bool = False,
                 pin_frozen_share: float = 0.5, channels_last: bool = False, gpu_layers: int = 0, gpu_device: Any = None):
        """``gpu_layers``: how many leading layers keep master and gradients on ``gpu_device`` (gpushare.py)."""
        for layer in layers:
            for name, p in layer.named_parameters():
                if not p.is_floating_point():
                    raise ValueError(f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters are supported")
        self.layers = layers
        self.pin_memory = pin_memory
        self.params = FlatLayout.of_parameters(layers, trainable=True, channels_last=channels_last)
        self.frozen_layout = FlatLayout.of_parameters(layers, trainable=False, channels_last=channels_last)
        self.buffer_layout = FlatLayout.of_buffers(layers)
        originals = [p for p in self._unique_tensors(layers, "parameters") if p.requires_grad]
        self.frozen_params = [p for p in self._unique_tensors(layers, "parameters") if not p.requires_grad]
        self.frozen = self._store_frozen(pin_memory, pin_frozen_share)

        self.compute = [self.params.allocate(pin_memory), self.params.allocate(pin_memory)]
        # Pinned when GPUs cast their resident copy from it (refresh.py): DMA reads it directly.
        self.master = torch.zeros(self.params.total, dtype=optim_dtype, pin_memory=pin_master)
        with torch.no_grad():
            for slot, p in zip(self.params.slots, originals):
                self.params.view(self.compute[0], slot).copy_(p.detach())
                self.params.master_view(self.master, slot).copy_(p.detach())
        self.gpu = GpuShare(self.params, gpu_layers, gpu_device, optim_dtype) if gpu_layers else None
        self.master_params = [nn.Parameter(self._master_view(slot), requires_grad=slot.requires_grad) for slot in self.params.slots]
        if self.gpu is not None:
            with torch.no_grad():
                for slot, p, m in zip(self.params.slots, originals, self.master_params):
                    if self.gpu.holds(slot):
                        m.copy_(p.detach())

        self.buffers = self.buffer_layout.allocate(pin_memory)
        with torch.no_grad():
            for slot, b in zip(self.buffer_layout.slots, self._unique_tensors(layers, "buffers")):
                self.buffer_layout.view(self.buffers, slot).copy_(b.detach())
            # The user's modules now look at our storage: their old tensors can be freed.
            for slot, b in zip(self.buffer_layout.slots, self._unique_tensors(layers, "buffers")):
                b.data = self.buffer_layout.view(self.buffers, slot)
        self.user_params = originals
        self.show_version(0)
        self.grads: list[GradBuffer] = [GradBuffer(self.params, pin_memory, self.gpu)]

    def _store_frozen(self, pin_memory: bool, pin_share: float) -> dict[str, Tensor]:
        """One flat copy of the frozen parameters; each original is let go as soon as it is copied,
        so host memory peaks at the frozen size plus one tensor (``torch.empty`` commits pages only
        when they are written). Pinned when a GPU reads it and it takes at most ``pin_share`` of the
        machine's memory (tuning.py says why)."""
        layout = self.frozen_layout
        nbytes = sum(n * layout.dtypes[k].itemsize for k, n in layout.sizes.items())
        pin = pin_memory and pins_frozen(nbytes, pin_share)
        flats = {k: torch.empty(n, dtype=layout.dtypes[k], pin_memory=pin) for k, n in layout.sizes.items()}
        ends = dict.fromkeys(flats, 0)
        with torch.no_grad():
            for slot, p in zip(layout.slots, self.frozen_params):
                flats[slot.key][ends[slot.key] : slot.offset].zero_()  # alignment padding
                view = layout.view(flats, slot)
                view.copy_(p.detach())
                p.data = view
                ends[slot.key] = slot.offset + slot.numel
            for key, flat in flats.items():
                flat[ends[key] :].zero_()
        return flats

    def nbytes(self) -> dict[str, int]:
        """Host bytes held per kind of state."""
        size = lambda flats: sum(t.untyped_storage().nbytes() for t in flats)
        return {
            "master": size([self.master]),
            "grads": size([g.flat for g in self.grads]),
            "compute": size([t for copy in self.compute for t in copy.values()]),
            "frozen": size(self.frozen.values()),
            "buffers": size(self.buffers.values()),
        }

    def report(self, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, int]:
        """``nbytes()``, the host bytes of ``optimizer``'s state tensors (when given) and the ``total``."""
        report = self.nbytes()
        if optimizer is not None:
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for state in optimizer.state.values() for t in state.values() if isinstance(t, Tensor) and t.device.type == "cpu"}
            report["optimizer"] = sum(storages.values())
        report["total"] = sum(report.values())
        return report

    def master_of(self) -> dict[int, nn.Parameter]:
        """id(user parameter) -> its master parameter."""
        return {id(p): m for p, m in zip(self.user_params, self.master_params)}

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
            self.grads.append(GradBuffer(self.params, self.pin_memory, self.gpu))
        return self.grads[index]

    def _master_view(self, slot) -> Tensor:
        if self.gpu is not None and self.gpu.holds(slot):
            return self.gpu.view(self.gpu.master, slot)
        return self.params.master_view(self.master, slot)

    def master_range(self, r: Range) -> Tensor:
        """Range ``r`` of the master, where it lives (``r`` lies on one side of the GPU share's cut)."""
        if self.gpu is not None and r.start < self.gpu.cut[r.key]:
            return self.gpu.master[r.key][r.start : r.stop]
        return self.params.master_range(self.master, r)

    def split(self, r: Range) -> list[Range]:
        """``r`` cut where the GPU share ends."""
        return [r] if self.gpu is None else [part for part in self.gpu.split(r) if part is not None]

    def write_compute(self, version: int) -> None:
        """Compute copy ``version`` := master cast to the model's dtype (one pass per dtype)."""
        for key, flat in self.compute[version % 2].items():
            for r in self.split(Range(key, 0, flat.numel())):
                self.write_compute_range(version, r)

    def write_compute_range(self, version: int, r: Range) -> None:
        """One range of compute copy ``version`` := the master's, cast (where the master lives)."""
        dst, src = self.compute_range(version, r), self.master_range(r)
        dst.copy_(src if src.device == dst.device else src.to(dst.dtype))  # a GPU share is cast there, then copied

    def compute_range(self, version: int, r: Range) -> Tensor:
        return self.compute[version % 2][r.key][r.start : r.stop]

    def buffer_range(self, r: Range) -> Tensor:
        return self.buffers[r.key][r.start : r.stop]
