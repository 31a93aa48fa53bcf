"""Staging a new version of the weights on GPUs that keep the whole model resident.

After an optimizer step the compute copy (the model's dtype, e.g. bf16) has to be made from the
fp32 master and uploaded. Casting on the host costs a pass over host memory (read 4 bytes, write 2
per parameter: 0.29 s for 3.2 B parameters on the H200 machine) that sits between one optimizer step
and the next, and two host compute copies to cast into. A GPU casts for free but has to receive
fp32, twice the bytes of bf16. By default (``Tuning.refresh_gpu_share`` 1) every flat tensor goes up
straight from the (pinned) master in chunks and is cast on the GPU, and the host keeps no compute
copy at all. Below 1 the work is split: that share goes up as fp32 while the host casts the rest in
chunks into its compute copy, each uploaded as soon as it is written; the two run at the same time,
on the copy engine and on the CPU cores.

The call returns when every copy out of host memory has finished: only then may the next optimizer
step change the master. The GPU share of the master (gpushare.py) is on the GPU already: its
ranges are cast there, with no upload and no host pass.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .device import Device
from .host import HostState
from .layout import FlatLayout, Range
from .tuning import Tuning

_ALIGN = 1024  # elements: keeps every chunk boundary aligned for vector loads


def split(layout: FlatLayout, master_dtype: torch.dtype, gpu_share: float, chunk: int = Tuning.refresh_chunk,
          cut: Optional[dict[str, int]] = None) -> tuple[list[Range], list[Range]]:
    """(ranges cast on the GPU, ranges cast on the host), in chunks of ``chunk`` elements. ``cut``:
    where each flat tensor's GPU share of the master ends (gpushare.py): that prefix is on the GPU
    already and is cast there. Of the rest, ``gpu_share`` goes up as fp32 (``Tuning.refresh_gpu_share``).

    A flat tensor at least as wide as the master goes up whole from the master: casting it on the
    host would save no bytes.
    """
    if not 0.0 <= gpu_share <= 1.0:
        raise ValueError(f"gpu_share must be in [0, 1], got {gpu_share}")
    on_gpu: list[Range] = []
    on_host: list[Range] = []
    for key, size in layout.sizes.items():
        resident = (cut or {}).get(key, 0)
        if master_dtype.itemsize <= layout.dtypes[key].itemsize or gpu_share == 1.0:
            upload = size
        else:
            upload = min(size, resident + int((size - resident) * gpu_share) // _ALIGN * _ALIGN)
        on_gpu += _chunks(key, 0, resident, chunk) + _chunks(key, resident, upload, chunk)
        on_host += _chunks(key, upload, size, chunk)
    return on_gpu, on_host


def _chunks(key: str, start: int, stop: int, chunk: int) -> list[Range]:
    return [Range(key, a, min(a + chunk, stop)) for a in range(start, stop, chunk)]


def stage_version(host: HostState, devices: Sequence[Device], version: int, plan: tuple[list[Range], list[Range]]) -> dict[int, tuple[list[tuple[Range, Tensor]], object]]:
    """Compute copy ``version`` on every device, made from the master: device index -> (one
    (range, tensor) piece per flat tensor, event marking it complete). Blocks until no copy reads
    host memory any more (a version cast wholly from the GPU share's master returns at once)."""
    layout = host.params
    on_gpu, on_host = plan
    in_share = lambda r: host.gpu is not None and r.start < host.gpu.cut[r.key]
    reads_host = bool(on_host) or not all(in_share(r) for r in on_gpu)
    staged: dict[int, dict[str, Tensor]] = {}
    events: dict[int, object] = {}
    try:
        for device in devices:
            device.follow_caller("prefetch")  # after the step that wrote the master (queued on this thread's stream)
            with device.stream("prefetch"):
                flats = {k: torch.empty(n, dtype=layout.dtypes[k], device=device.torch_device) for k, n in layout.sizes.items()}
                staged[device.index] = flats
                for r in on_gpu:
                    source = host.master_range(r)
                    if in_share(r):  # the GPU share: cast where it lives
                        flats[r.key][r.start : r.stop].copy_(source)
                    elif source.dtype == flats[r.key].dtype:
                        flats[r.key][r.start : r.stop].copy_(source, non_blocking=True)
                    else:  # copy_ across devices would cast on the host: upload as is, then cast here
                        flats[r.key][r.start : r.stop].copy_(device.upload(source))
        for r in on_host:  # the host casts chunk by chunk; each goes up while the next is cast
            host.write_compute_range(version, r)
            for device in devices:
                with device.stream("prefetch"):
                    staged[device.index][r.key][r.start : r.stop].copy_(host.compute_range(version, r), non_blocking=True)
    finally:  # also after an error (e.g. no GPU memory left): no copy may still read the master
        for device in devices:
            with device.stream("prefetch"):
                events[device.index] = device.record("prefetch")
            if reads_host:
                events[device.index].synchronize()
    return {index: ([(Range(k, 0, t.numel()), t) for k, t in flats.items()], events[index]) for index, flats in staged.items()}
