"""``ResidentStore``: the whole compute copy stays on every GPU (weights.py says when).

Each version is staged once per GPU into an upload slot (by the optimizer thread, from the master:
refresh.py); jobs read a "live" copy that is always the same memory (CUDA graphs rely on it),
refreshed from the slot when the version changes. Frozen weights go up once per GPU. A fused stage
replayed as CUDA graphs also keeps its buffers and gradient tensors in static memory.

The host keeps no compute copy (host.py): every version is cast on the GPUs from the master, the
GPU share's where it lives and the host's uploaded as fp32 (``Tuning.refresh_gpu_share`` 1: 73 ms
against 60 ms at 0.4 for 990 M parameters on the H200, overlapped with the next call; below 1 the
host casts part into two compute copies of its own). A version no step staged (the first, and after
synchronize()) is staged from the master when asked for, which holds it then. The user's
parameters stay on the host (host.py: written from the master at synchronize()).
"""
from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from . import refresh
from .device import Device
from .host import HostState
from .layout import Range
from .schedule import Job
from .tuning import Tuning
from .weights import StageTensors, StreamedStore, _whole


class _Resident:
    """The whole compute copy on one GPU: upload slots by version, and the live copy jobs read."""

    def __init__(self) -> None:
        self.staged: dict[int, StageTensors] = {}
        self.live: Optional[StageTensors] = None  # one object, refreshed in place (CUDA graphs read it)
        self.live_version: Optional[int] = None

    def publish(self, version: int, staged: StageTensors) -> None:
        """Keep ``staged`` as ``version`` and forget versions no call can ask for any more."""
        self.staged[version] = staged
        for old in [v for v in self.staged if v < version - 1]:
            del self.staged[old]


class ResidentStore(StreamedStore):
    def __init__(self, host: HostState, tuning: Tuning, devices: Sequence[Device]):
        super().__init__(host, tuning)
        self.devices = devices
        self.resident: dict[int, _Resident] = {}
        self._frozen_copies: dict[int, StageTensors] = {}  # device index -> the frozen weights, whole
        self._lock = threading.Lock()
        self._static_buffers: dict[tuple[int, int, int], StageTensors] = {}
        self._static_grads: dict[tuple[int, int, int], StageTensors] = {}
        share = tuning.refresh_gpu_share if host.compute is not None else 1.0  # the host casts only into its copies
        self._refresh_plan = refresh.split(host.params, host.master.dtype, share, tuning.refresh_chunk, host.gpu.cut if host.gpu else None)
        self.prefetch_version(0)  # on every GPU now: a step may change the master before a GPU's first call

    # ----------------------------------------------------------------------------- weights
    def weights(self, device: Device, job: Job, version: int, front: Any = None) -> tuple[StageTensors, StageTensors]:
        if front is not None:  # (calls overlap a step only where the weights stream: versions.py)
            front.wait_finished()
        return self._live(device, version), self._frozen(device, job)

    def _frozen(self, device: Device, job: Job) -> StageTensors:
        with self._lock:
            found = self._frozen_copies.get(device.index)
            if found is None:
                with device.stream("upload"):
                    pieces = [(r, device.upload(t)) for r, t in _whole(self.host.frozen_layout, self.host.frozen)]
                    found = self._frozen_copies[device.index] = StageTensors(self.host.frozen_layout, pieces, device.record("upload"))
            return found

    def frozen_changed(self) -> None:
        with self._lock:
            for index, found in self._frozen_copies.items():
                device = self.devices[index]
                with device.stream("upload"):
                    for r, t in found.pieces:
                        t.copy_(self.host.frozen[r.key], non_blocking=True)
                    found.event = device.record("upload")

    def copy(self, device: Device, version: int) -> StageTensors:
        """Compute copy ``version`` on ``device``: staged by the step that wrote it, or else now
        from the master, which holds this version whenever a version is not staged by its step
        (the first, and after synchronize(); a step whose staging failed leaves it there too, unless
        the user has stepped again: staging then waits for that step, never reading half of it)."""
        with self._lock:
            resident = self.resident.get(device.index)
            found = resident.staged.get(version) if resident is not None else None
        if found is not None:
            return found
        with self.host.master_lock, self._lock:  # in the optimizer thread's order: master, then this store
            resident = self.resident.setdefault(device.index, _Resident())
            found = resident.staged.get(version)
            if found is None:
                if self.host.gpu is not None:
                    self.host.gpu.wait_queued()  # e.g. load_state_dict's copies into the GPU master
                [(pieces, event)] = refresh.stage_version(self.host, [device], version, self._refresh_plan).values()
                found = StageTensors(self.host.params, pieces, event)
                resident.publish(version, found)
            return found

    def _live(self, device: Device, version: int) -> StageTensors:
        """The live copy, holding ``version``. Its upload slot goes once the live copy holds it (calls ask
        for versions in order, and the live copy serves a version again): a GPU keeps the live copy and the
        slot a step is staging, not a third copy of the version the calls read."""
        resident = self.resident.get(device.index)
        if resident is not None and resident.live is not None and resident.live_version == version:
            return resident.live
        staged = self.copy(device, version)
        resident = self.resident[device.index]
        if resident.live is None:
            resident.live = StageTensors(self.host.params, [(r, torch.empty_like(t)) for r, t in staged.pieces])
        with device.stream("compute"):
            device.wait("compute", staged.event)
            device.check_ready("compute", (t for _, t in staged.pieces))
            for (_, live), (_, t) in zip(resident.live.pieces, staged.pieces):
                live.copy_(t)
                device.keep_alive(t, "compute")  # its memory is not reused before this copy has read it
        resident.live_version = version
        with self._lock:
            if resident.staged.get(version) is staged:
                del resident.staged[version]
        return resident.live

    def prefetch_version(self, version: int) -> None:
        for device in self.devices:
            self.copy(device, version)

    def publish(self, version: int) -> None:
        """Version ``version`` on every GPU, cast there from the master (refresh.py). Returns once
        the master may change again. If staging fails (say no GPU memory is left) the error goes to
        the caller and a call that needs the version stages it from the master (``copy``)."""
        with self._lock:  # no call asks for versions before version - 1: free them before staging a new one
            for resident in self.resident.values():
                for old in [v for v in resident.staged if v < version - 1]:
                    del resident.staged[old]
        staged = refresh.stage_version(self.host, self.devices, version, self._refresh_plan)
        with self._lock:  # held only to publish: a running call looks up its own version here
            for index, (pieces, event) in staged.items():
                self.resident.setdefault(index, _Resident()).publish(version, StageTensors(self.host.params, pieces, event))

    def drop(self) -> None:
        with self._lock:
            self.resident.clear()
            self._frozen_copies.clear()
        self._static_buffers.clear()
        self._static_grads.clear()

    # ----------------------------------------------------------------------------- static tensors of a graphed stage
    def _buffer_pieces(self, device: Device, job: Job, static: bool) -> list[tuple[Range, Tensor]]:
        if not static:
            return super()._buffer_pieces(device, job, static)
        key = (device.index, job.start, job.stop)  # a recorded graph reads and updates these very tensors
        if key not in self._static_buffers:
            self._static_buffers[key] = StageTensors(self.host.buffer_layout, super()._buffer_pieces(device, job, static))
        pieces = self._static_buffers[key].pieces
        for r, t in pieces:
            t.copy_(self.host.buffer_range(r), non_blocking=True)
        return pieces

    def grads(self, device: Device, job: Job, static: bool) -> StageTensors:
        """The same memory every call when a recorded graph accumulates into it (the call's end
        synchronizes, so the last download is done)."""
        if not static:
            return super().grads(device, job, static)
        key = (device.index, job.start, job.stop)
        grads = self._static_grads.get(key)
        if grads is None:
            grads = self._static_grads[key] = super().grads(device, job, static)
        else:
            for _, t in grads.pieces:
                t.zero_()
        return grads
