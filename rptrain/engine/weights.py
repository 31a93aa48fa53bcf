"""The weight store: where a job's weights, frozen weights, buffers and gradient tensors come from.

Chosen once per engine (``make_store``):

- ``HostStore`` (CPU devices): the host copies themselves, nothing moves.
- ``StreamedStore`` (GPUs, model too big to stay): every job uploads its stage on the upload stream
  (the executor prefetches the next job's while the current one computes); a GPU share's layers
  (single version only) are copied from their master on the GPU instead.
- ``ResidentStore`` (GPUs, model fits; resident.py): the whole compute copy stays on every GPU.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from torch import Tensor

from .device import Device
from .host import HostState
from .layout import FlatLayout, Range, Slot, shaped
from .schedule import Job
from .tuning import Tuning

if TYPE_CHECKING:
    from ..optim.front import StepFront


class StageTensors:
    """Device tensors holding some ranges of a flat layout, and views of single slots in them."""

    def __init__(self, layout: FlatLayout, pieces: list[tuple[Range, Tensor]], event: Any = None):
        self.layout = layout
        self.pieces = pieces
        self.event = event

    def view(self, slot: Slot) -> Tensor:
        return shaped(self.flat(slot), slot)

    def flat(self, slot: Slot) -> Tensor:
        """The slot's elements as one 1-D tensor, in storage order."""
        for r, t in self.pieces:
            if r.key == slot.key and r.start <= slot.offset < r.stop:
                start = slot.offset - r.start
                return t[start : start + slot.numel]
        raise KeyError(f"slot {slot.index} is not part of this stage")


def _whole(layout: FlatLayout, flats: dict[str, Tensor]) -> list[tuple[Range, Tensor]]:
    return [(Range(k, 0, t.numel()), t) for k, t in flats.items()]


class HostStore:
    """CPU devices: jobs read and write the host copies directly."""

    def __init__(self, host: HostState, tuning: Tuning):
        self.host = host
        self.tuning = tuning

    def weights(self, device: Device, job: Job, version: int, front: Optional[StepFront] = None) -> tuple[StageTensors, StageTensors]:
        host = self.host
        if front is not None:  # (calls overlap a step only where the weights stream: versions.py)
            front.wait_finished()
        return StageTensors(host.params, _whole(host.params, host.compute[version % 2])), StageTensors(host.frozen_layout, _whole(host.frozen_layout, host.frozen))

    def buffers(self, device: Device, job: Job, scratch: bool, static: bool, events: list) -> StageTensors:
        layout = self.host.buffer_layout
        pieces = [(r, self.host.buffer_range(r)) for r in layout.ranges(job.start, job.stop)]
        if scratch:  # a recompute must not update running statistics twice
            pieces = [(r, t.clone()) for r, t in pieces]
        return StageTensors(layout, pieces)

    def grads(self, device: Device, job: Job, static: bool) -> StageTensors:
        layout = self.host.params
        return StageTensors(layout, [(r, device.zeros(r.numel, layout.dtypes[r.key])) for r in layout.ranges(job.start, job.stop)])

    def publish(self, version: int) -> None:
        """The optimizer thread wrote the master: make compute copy ``version`` from it."""
        self.host.write_compute(version)

    def prefetch_version(self, version: int) -> None:
        """Compute copy ``version`` is whole on the host: stage it where jobs will read it."""

    def frozen_changed(self) -> None:
        """The host's frozen weights were overwritten (load_state_dict)."""

    def drop(self) -> None:
        """Free device memory (close)."""


class StreamedStore(HostStore):
    """GPUs: every job uploads its stage's tensors on the upload stream."""

    def weights(self, device: Device, job: Job, version: int, front: Optional[StepFront] = None) -> tuple[StageTensors, StageTensors]:
        """``front``: the step writing ``version`` still runs (a call overlapping it): each range is read once done."""
        params = self.host.params
        with device.stream("upload"):
            pieces = [(part, device.upload(self._source(version, part, device, front)))
                      for r in params.ranges(job.start, job.stop) for part in self._split(r)]
            weights = StageTensors(params, pieces, device.record("upload"))
        return weights, self._frozen(device, job)

    def _split(self, r: Range) -> list[Range]:
        """``r`` as its part in the GPU share and its part on the host (where there is a share)."""
        return [part for part in self.host.gpu.split(r) if part is not None] if self.host.gpu is not None else [r]

    def _source(self, version: int, r: Range, device: Device, front: Optional[StepFront]) -> Tensor:
        """Where range ``r`` of compute copy ``version`` comes from: the host's copy, or for the GPU share
        (a single version, so no step writes it while a call runs: gpushare.py) its master on the GPU, cast.
        Under ``front`` the upload stream first waits for the step to have written it."""
        gpu = self.host.on_gpu_range(r)
        source = self.host.gpu.master[r.key][r.start : r.stop] if gpu else self.host.compute_range(version, r)
        if front is not None:
            for event in front.wait(source):
                device.wait("upload", event)
        return source.to(self.host.params.dtypes[r.key], copy=True) if gpu else source

    def _frozen(self, device: Device, job: Job) -> StageTensors:
        layout = self.host.frozen_layout
        with device.stream("upload"):
            pieces = [(r, device.upload(self.host.frozen[r.key][r.start : r.stop])) for r in layout.ranges(job.start, job.stop)]
            return StageTensors(layout, pieces, device.record("upload"))

    def buffers(self, device: Device, job: Job, scratch: bool, static: bool, events: list) -> StageTensors:
        layout = self.host.buffer_layout
        with device.stream("upload"):
            for event in events:  # statistics written back by earlier jobs of this call
                device.wait("upload", event)
            pieces = self._buffer_pieces(device, job, static)
            return StageTensors(layout, pieces, device.record("upload"))

    def _buffer_pieces(self, device: Device, job: Job, static: bool) -> list[tuple[Range, Tensor]]:
        return [(r, device.upload(self.host.buffer_range(r))) for r in self.host.buffer_layout.ranges(job.start, job.stop)]
