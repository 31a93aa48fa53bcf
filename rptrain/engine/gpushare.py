"""The GPU share of the training state: the leading layers' master weights and gradients on the GPU.

placement.py decides how many leading layers (``Placement.gpu_layers``); their trainable tensors are
a prefix ``[0, cut[key])`` of each flat tensor of the layout (layout.py numbers tensors in layer
order), so the share is one GPU tensor per dtype for the master and one per gradient buffer, viewed
per slot exactly like the host's. The master parameters the optimizer gets are those views, so the
user's optimizer keeps the share's state on the GPU and steps it there; its gradients land there
(grads.py) and the next compute copy is cast from it on the GPU (refresh.py). The host keeps the
rest.

Ordering: the step's kernels run on the optimizer thread's stream; its task waits for them
(``wait_queued``) before it lets the window's gradient buffer go and stages the next version, so
the backward that reuses the buffer two calls later, and the staging copies, come after them.
Each gradient buffer has its own GPU part: the next call writes the other one while the step
runs. rptrain.optim queues the GPU runs' kernels before grinding the host's, so both shares step
at the same time (torch's own optimizers group devices in a hash map's order).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .device import Device
from .layout import FlatLayout, Range, Slot, shaped
from .tuning import Tuning


def cuts(layout: FlatLayout, layers: int) -> dict[str, int]:
    """Where the share of the first ``layers`` layers ends in each flat tensor of ``layout``."""
    out = {}
    for key, size in layout.sizes.items():
        later = [s.offset for s in layout.slots if s.key == key and s.owner >= layers]
        out[key] = min(later) if later else size
    return out


class GpuShare:
    def __init__(self, layout: FlatLayout, layers: int, device: Device, optim_dtype: torch.dtype, optimizer_bytes: float,
                 grad_dtype: torch.dtype = torch.float32, grad_buffers: int = 2):
        """``optimizer_bytes``: the optimizer's state per parameter (its class declares it: rptrain/optim/state.py);
        ``grad_buffers``: how many gradient buffers will hold a part here (host.py)."""
        self.layout, self.layers, self.device, self.optim_dtype = layout, layers, device, optim_dtype
        self.optimizer_bytes, self.grad_dtype, self.grad_buffers = optimizer_bytes, grad_dtype, grad_buffers
        self.cut = cuts(layout, layers)
        self.master = self.allocate(optim_dtype)

    def allocate(self, dtype: torch.dtype) -> dict[str, Tensor]:
        """One zeroed GPU tensor per flat tensor, covering its share (dtypes without one get none)."""
        return {k: torch.zeros(c, dtype=dtype, device=self.device.torch_device) for k, c in self.cut.items() if c}

    def holds(self, slot: Slot) -> bool:
        return slot.offset < self.cut[slot.key]

    def view(self, flats: dict[str, Tensor], slot: Slot) -> Tensor:
        return shaped(flats[slot.key][slot.offset : slot.offset + slot.numel], slot)

    def split(self, r: Range) -> tuple[Optional[Range], Optional[Range]]:
        """(the part of ``r`` in the GPU share, the part on the host); None where empty."""
        cut = min(max(self.cut[r.key], r.start), r.stop)
        return (Range(r.key, r.start, cut) if cut > r.start else None, Range(r.key, cut, r.stop) if r.stop > cut else None)

    def state_bytes(self) -> int:
        """GPU bytes of the share's state: master, its gradient buffers (two; one with a single version), the optimizer's state."""
        per = self.optim_dtype.itemsize + self.grad_buffers * self.grad_dtype.itemsize + self.optimizer_bytes
        return int(sum(self.cut.values()) * per)

    def wait_queued(self) -> None:
        """Wait for the GPU work queued on the device's current stream (the optimizer's kernels on the
        GPU share, a load_state_dict's copies into its master): after this, the gradient buffer they
        read may be written again and the master read on other streams."""
        if self.device.torch_device.type == "cuda":
            torch.cuda.current_stream(self.device.torch_device).synchronize()


def gpu_state_allowed(requested: bool, devices: list[Device], resident: bool, tuning: Tuning,
                      single_version: bool = False) -> tuple[bool, float, tuple[str, ...]]:
    """Whether trainable state may go to the GPU, the share of free GPU memory kept for activations,
    and why not where it may not (printed with the placement).

    One GPU per process: with several, every GPU keeps the whole compute copy and computes every
    stage of the schedule, so no one of them owns a layer's state; the state stays on the host there.
    The model must stay resident (the GPU share's compute copy is cast from its master on the GPU,
    into the resident store's upload slot), unless the engine keeps a single version of the weights:
    then a call reads no stage before the step has written it (a call overlapping a step waits for its
    parts: rptrain/optim/front.py), and a streaming call copies the share's weights from its master on
    the GPU (weights.py)."""
    if not isinstance(requested, bool):
        raise TypeError(f"gpu_state must be True or False, got {requested!r}")
    if not requested:
        return False, 0.0, ("state on the host: gpu_state=False",)
    if not devices[0].is_cuda:
        return False, 0.0, ()
    if len(devices) > 1:
        return False, 0.0, (f"state on the host: {len(devices)} GPUs in one process (GPU state needs one GPU per process, e.g. torchrun)",)
    if not resident and not single_version:
        return False, 0.0, ("state on the host: the model streams (two versions of its weights exceed Tuning.resident_share_gpu_state "
                       "of the GPU); GPU state needs the whole compute copy on the GPU, or single_version",)
    if resident:
        return True, tuning.gpu_state_reserve, ()
    # Streamed: the smaller share, but no fewer bytes than the floor (an 80 GB card keeps what it was measured with).
    floor = min(tuning.gpu_state_reserve, tuning.streamed_reserve_floor / max(devices[0].free_memory(), 1))
    return True, max(tuning.streamed_gpu_state_reserve, floor), ()
