"""Host memory: master weights, two compute copies, buffers, two gradient buffers and frozen weights.

- ``master``: one flat tensor in ``optim_dtype`` holding every trainable parameter (``requires_grad``);
  the optimizer owns views of it.
- ``compute[v % 2]``: version ``v`` of the weights in the model's dtype, one flat tensor per dtype
  (pinned when a GPU reads it). Two copies let the optimizer write version v+1 while a call reads v.
  None when the GPUs keep the whole model resident (resident.py): they cast every version from the
  master themselves (refresh.py), so host copies would be waste (2 x 2 bytes a bf16 parameter).
- ``buffers``: BatchNorm statistics and other buffers, one flat tensor per dtype, updated in place.
- ``grads[w]``: two flat gradient buffers in the master's layout, fp32 (bf16 with a bf16 master:
  ``grad_dtype``). A call accumulates into the open window's buffer while the optimizer may still
  read the other one.
- ``frozen``: parameters with ``requires_grad=False`` (e.g. a LoRA base model), stored once in their own
  dtype, one flat tensor per dtype, read-only: no master, no gradient, no second copy, since nothing
  ever writes them. ``requires_grad`` is read when the engine wraps the model.

Bytes per parameter: trainable = compute dtype x 2 (0 when resident) + optim dtype (master) + grad
dtype x 1 or 2 (gradient buffers; the second only for async steps) + the optimizer's state (what its
class declares: rptrain/optim/state.py); frozen = its own dtype x 1.

With a GPU share (gpushare.py) the leading layers' master and gradients live on the GPU and their
compute copy only there: the host's flat tensors of trainable state hold the rest (``HostShare``).

The user's model parameters stay on the host (``show_version``): views of the host's compute copy of
the newest call, or, where the host keeps none, tensors of their own written at ``synchronize()``.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from . import pinned
from .gpushare import GpuShare
from .host_fill import fill
from .layout import ALIGN_ATTR, FlatLayout, Range, Slot, _align, align_step, shaped


def grad_dtype(optim_dtype: torch.dtype) -> torch.dtype:
    """The gradient buffers' dtype: bf16 where the master is bf16 (gradients travel and accumulate in the
    master's dtype; the step works in fp32 and rounds stochastically), else fp32."""
    return torch.bfloat16 if optim_dtype == torch.bfloat16 else torch.float32


def master_is_compute_copy(params: FlatLayout, optim_dtype: torch.dtype) -> bool:
    """Whether one version's host compute copy can be the master itself: every trainable tensor is in the master's dtype."""
    return all(dtype == optim_dtype for dtype in params.dtypes.values())


def pins_frozen(nbytes: int, pin_share: float) -> bool:
    """Whether frozen weights of ``nbytes`` are pinned on a GPU engine: at most ``pin_share`` of the
    machine's physical memory (fit.py predicts the same)."""
    return nbytes <= pin_share * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class HostShare:
    """What the host keeps of each flat tensor of a layout: elements ``[cut[key], size)`` (all of them
    without a GPU share; gpushare.py). Host flats of the model's dtype start at ``cut[key]``; the
    master and the gradient buffers concatenate every dtype's host part, each aligned like layout.py's."""

    def __init__(self, layout: FlatLayout, cut: dict[str, int]):
        self.layout, self.cut = layout, cut
        self.sizes = {k: n - cut[k] for k, n in layout.sizes.items()}
        self.base: dict[str, int] = {}
        total = 0
        for key, n in self.sizes.items():
            self.base[key] = total
            total += _align(n, torch.float32)
        self.total = total

    def allocate(self, pin_memory: bool) -> dict[str, Tensor]:
        return {k: pinned.zeros(n, self.layout.dtypes[k], pin_memory) for k, n in self.sizes.items()}

    def view(self, flats: dict[str, Tensor], slot: Slot) -> Tensor:
        return self.layout.view(flats, slot, self.cut[slot.key])

    def range(self, flats: dict[str, Tensor], r: Range) -> Tensor:
        return flats[r.key][r.start - self.cut[r.key] : r.stop - self.cut[r.key]]

    def master_range(self, master: Tensor, r: Range) -> Tensor:
        start = self.base[r.key] + r.start - self.cut[r.key]
        return master[start : start + r.numel]

    def master_view(self, master: Tensor, slot: Slot) -> Tensor:
        return shaped(self.master_range(master, Range(slot.key, slot.offset, slot.offset + slot.numel)), slot)

    def ranges(self) -> list[Range]:
        return [Range(k, self.cut[k], self.cut[k] + n) for k, n in self.sizes.items() if n]


class GradBuffer:
    """One gradient buffer (``dtype``: grad_dtype) and which slots of it hold this window's gradients: on
    the host, and on the GPU for the GPU share (``gpu``, one tensor per dtype; gpushare.py)."""

    def __init__(self, host: HostShare, pin_memory: bool, share: Optional[GpuShare] = None, dtype: torch.dtype = torch.float32):
        self.host, self.dtype = host, dtype
        self.flat = pinned.zeros(host.total, dtype, pin_memory)
        self.gpu = share.allocate(dtype) if share is not None else {}
        self.views = [share.view(self.gpu, slot) if share is not None and share.holds(slot) else host.master_view(self.flat, slot)
                      for slot in host.layout.slots]  # master .grad per slot
        self.written = [False] * len(host.layout.slots)
        self.free = threading.Event()  # set when nothing (optimizer .grad views) refers to it
        self.free.set()
        self.held = False  # a failed or partial step left master .grad views into it (roundpipe.py)
        self.stepped: dict[int, Any] = {}  # device index -> the event after the GPU work of the last step that read it

    def reset(self) -> None:
        self.written = [False] * len(self.written)

    def on_gpu(self, r: Range) -> bool:
        """Whether range ``r`` lies in the GPU share."""
        return r.key in self.gpu and r.stop <= self.gpu[r.key].numel()

    def owns(self, t: Optional[Tensor]) -> bool:
        """Whether ``t`` is a view of this buffer (host or GPU part)."""
        if t is None:
            return False
        ptr = t.untyped_storage().data_ptr()
        return any(ptr == f.untyped_storage().data_ptr() for f in (self.flat, *self.gpu.values()))


class HostState:
    def __init__(self, layers: Sequence[nn.Module], optim_dtype: torch.dtype, pin_memory: bool, pin_master: bool = False,
                 pin_frozen_share: float = 0.5, channels_last: bool = False, gpu_layers: int = 0, gpu_device: Any = None,
                 compute_copies: bool = True, optimizer_bytes: Optional[float] = None, keep_user_weights: bool = True,
                 materialise: Optional[Callable[[int], None]] = None, single_version: bool = False):
        """``gpu_layers``: how many leading layers keep master and gradients on ``gpu_device`` (gpushare.py);
        ``compute_copies``: False where resident GPUs cast every version themselves (no host compute copies);
        ``optimizer_bytes``: the optimizer's state per parameter (None: Adam's two moments in ``optim_dtype``);
        ``keep_user_weights``: False lets the user's tensors go where the host keeps no compute copy (host_fill.py); ``materialise``: layers built on the meta device, made real one at a
        time by ``materialise(index)`` as they are copied in (host_fill.py)."""
        for layer in layers:
            for name, p in layer.named_parameters():
                if not p.is_floating_point():
                    raise ValueError(f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters are supported")
        self.layers = layers
        self.pin_memory = pin_memory
        # Held by the optimizer thread while a step changes the master and stages its version, and by a
        # call that stages a version from the master (resident.py): it never reads half a step's update.
        self.master_lock = threading.RLock()
        self.params = FlatLayout.of_parameters(layers, trainable=True, channels_last=channels_last)
        self.frozen_layout = FlatLayout.of_parameters(layers, trainable=False, channels_last=channels_last)
        self.buffer_layout = FlatLayout.of_buffers(layers)
        self.frozen = self._frozen_flats(pin_memory, pin_frozen_share)

        # The GPU share (gpushare.py) has its master and gradients on the GPU and its compute copy in
        # the resident store: the host allocates none of them.
        optimizer_bytes = 2 * optim_dtype.itemsize if optimizer_bytes is None else optimizer_bytes
        self.single_version = single_version
        self.gpu = GpuShare(self.params, gpu_layers, gpu_device, optim_dtype, optimizer_bytes, grad_dtype(optim_dtype),
                            1 if single_version else 2) if gpu_layers else None
        self.host = HostShare(self.params, self.gpu.cut if self.gpu else dict.fromkeys(self.params.sizes, 0))
        # One version whose tensors all have the master's dtype: the compute copy is the master (no cast, no copy).
        self.master_is_compute = single_version and compute_copies and master_is_compute_copy(self.params, optim_dtype)
        # Pinned when GPUs cast their resident copy from it (refresh.py) or upload it as the compute copy: DMA reads it directly.
        self.master = pinned.zeros(self.host.total, optim_dtype, pin_master or (self.master_is_compute and pin_memory))
        self.compute = None
        if compute_copies:  # versions v and v+1; with a single version both are one copy, the master's views where they can be
            first = ({k: self.master[self.host.base[k] : self.host.base[k] + n] for k, n in self.host.sizes.items()}
                     if self.master_is_compute else self.host.allocate(pin_memory))
            self.compute = [first, first if single_version else self.host.allocate(pin_memory)]
        self._shown: dict[int, list] = {}  # version parity -> the user's parameters' views of that host copy
        self._showing: Optional[int] = None  # the parity the user's parameters show now
        self.master_params = [nn.Parameter(self._master_view(slot), requires_grad=slot.requires_grad) for slot in self.params.slots]
        for slot, p in zip(self.params.slots, self.master_params):
            setattr(p, ALIGN_ATTR, align_step(self.params.dtypes[slot.key]))
        self.buffers = {k: pinned.zeros(n, self.buffer_layout.dtypes[k], pin_memory) for k, n in self.buffer_layout.sizes.items()}
        self.keeps_user_weights = keep_user_weights
        # Layer by layer: each layer's own tensors go once copied (host_fill.py); the user's modules then
        # look at our storage (or placeholders).
        self.user_params = fill(self, layers, materialise)
        if self.gpu is not None:
            self.gpu.wait_queued()  # the uploads into its master are done before other streams read it
        self.show_version(0)
        self.grad_dtype = grad_dtype(optim_dtype)
        self.grads: list[GradBuffer] = [GradBuffer(self.host, pin_memory, self.gpu, self.grad_dtype)]

    def _frozen_flats(self, pin_memory: bool, pin_share: float) -> dict[str, Tensor]:
        """The flats of the frozen parameters, stored once (host_fill.py writes them a parameter at a time:
        ``torch.empty`` commits pages only when written, so memory peaks at the frozen size plus one
        tensor). Pinned when a GPU reads them and they take at most ``pin_share`` of the machine's
        memory (tuning.py says why)."""
        layout = self.frozen_layout
        nbytes = sum(n * layout.dtypes[k].itemsize for k, n in layout.sizes.items())
        pin = pin_memory if pin_memory and pins_frozen(nbytes, pin_share) else False  # True or "register" (pinned.py)
        return {k: pinned.empty(n, layout.dtypes[k], pin) for k, n in layout.sizes.items()}

    def nbytes(self) -> dict[str, int]:
        """Host bytes held per kind of state."""
        size = lambda flats: sum(t.untyped_storage().nbytes() for t in flats)
        return {
            "master": size([self.master]),
            "grads": size([g.flat for g in self.grads]),
            "compute": 0 if self.master_is_compute else size({id(t): t for copy in self.compute or () for t in copy.values()}.values()),
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

    def show_version(self, version: int) -> None:
        """Point the user's model parameters at the host's compute copy ``version``. Parameters the
        host keeps no compute copy of (resident GPUs, the GPU share) keep host tensors of their own,
        written from the master by ``write_user_params`` (``synchronize()``): the user's module stays
        on the host, where the original library leaves it, whatever the engine keeps on a GPU."""
        if self.compute is None or self._showing == version % 2:
            return
        key = version % 2
        if key not in self._shown:  # building the views took 0.7-0.85 ms a call at ResNet-34 (bench/host_step.py, H200 cProfile)
            self._shown[key] = [None if self.on_gpu(slot) else self.host.view(self.compute[key], slot) for slot in self.params.slots]
        for p, view in zip(self.user_params, self._shown[key]):
            if view is not None:
                p.data = view
        self._showing = key

    def write_user_params(self) -> None:
        """The user's parameters that show no host compute copy := the master, cast (they live where
        the user put them: the host, unless the module was moved before wrapping)."""
        if not self.keeps_user_weights:
            return
        with torch.no_grad():
            for slot, p in zip(self.params.slots, self.user_params):
                if self.compute is None or self.on_gpu(slot):
                    p.detach().copy_(self._master_view(slot))

    def user_param_versions(self) -> list[int]:
        """Autograd's in-place version counters of the user's parameters: they change when anything writes them."""
        return [p._version for p in self.user_params]

    def read_user_params(self) -> None:
        """The master := the user's parameters (a user's own optimizer stepped them: roundpipe.py)."""
        with torch.no_grad():
            for slot, p in zip(self.params.slots, self.user_params):
                self._master_view(slot).copy_(p.detach())
        if self.gpu is not None:
            self.gpu.wait_queued()

    def on_gpu(self, slot: Slot) -> bool:
        return self.gpu is not None and self.gpu.holds(slot)

    def on_gpu_range(self, r: Range) -> bool:
        """Whether range ``r`` (on one side of the cut) lies in the GPU share."""
        return self.gpu is not None and r.start < self.gpu.cut[r.key]

    def grad_buffer(self, index: int) -> GradBuffer:
        while len(self.grads) <= index:  # the second buffer only when training runs asynchronously (never with a single version)
            self.grads.append(GradBuffer(self.host, self.pin_memory, self.gpu, self.grad_dtype))
        return self.grads[index]

    def _master_view(self, slot: Slot) -> Tensor:
        return self.gpu.view(self.gpu.master, slot) if self.on_gpu(slot) else self.host.master_view(self.master, slot)

    def master_sample(self, size: int = 100_000) -> Tensor:
        """About ``size`` evenly spaced master elements from the host and the GPU share, on the host
        (data-parallel ranks compare a fingerprint of them: reduce.py)."""
        parts = [self.master, *(self.gpu.master.values() if self.gpu is not None else ())]
        step = max(1, sum(t.numel() for t in parts) // size)
        return torch.cat([t[::step].cpu() for t in parts])

    def master_range(self, r: Range) -> Tensor:
        """Range ``r`` of the master, where it lives (``r`` lies on one side of the GPU share's cut)."""
        if self.gpu is not None and r.start < self.gpu.cut[r.key]:
            return self.gpu.master[r.key][r.start : r.stop]
        return self.host.master_range(self.master, r)

    def write_compute(self, version: int) -> None:
        """The host's compute copy ``version`` := its master cast to the model's dtype (one pass per
        dtype); nothing without host compute copies."""
        for r in self.host.ranges() if self.compute is not None else ():
            self.write_compute_range(version, r)

    def write_compute_range(self, version: int, r: Range) -> None:
        """One range of the host's compute copy ``version`` := the master's, cast (nothing where it is the master)."""
        if not self.master_is_compute:
            self.compute_range(version, r).copy_(self.master_range(r))

    def compute_range(self, version: int, r: Range) -> Tensor:
        return self.host.range(self.compute[version % 2], r)

    def buffer_range(self, r: Range) -> Tensor:
        return self.buffers[r.key][r.start : r.stop]
