"""A simulated GPU for tests: runs on the CPU but takes every CUDA code path of the engine.

``SimulatedDevice`` says ``is_cuda`` like a ``CudaDevice``, so the engine keeps weights resident,
prefetches the next stage, plans CUDA graphs, offloads activations and sends gradients early exactly
as on a GPU; its tensors are CPU tensors. Streams and events become ordering checks instead of
hardware queues:

- an event waited on must have been recorded (on this device or another one);
- an upload happens on the upload or prefetch stream, a copy home on the download stream;
- a tensor uploaded on one stream and read by the compute stream (``check_ready``) needs the
  compute stream to have waited on an event recorded on the upload's stream after the upload.

A broken order raises ``OrderingError`` where a GPU would silently read stale memory. CUDA graphs
cannot run on a CPU: ``graphs()`` gives a ``StageGraphs`` whose capture and replay run the stage
eagerly, so the decision and bookkeeping code runs while the numbers stay exact.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from .batching import map_tensors
from .device import STREAMS, Device
from .graphs import StageGraphs
from .tuning import Tuning


class OrderingError(RuntimeError):
    """Work on one simulated stream used a result of another without waiting for it."""


class SimEvent:
    """What ``record`` returns: the stream and how many events that stream had recorded before."""

    def __init__(self, device: int, stream: str, seq: int):
        self.device, self.stream, self.seq = device, stream, seq

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class SimulatedDevice(Device):
    is_cuda = True
    pins_memory = False

    def __init__(self, index: int, memory: int = 1 << 30):
        """``memory``: the bytes ``memory_cap()`` reports (the planner and residency read it)."""
        super().__init__(index, torch.device("cpu"))
        self.memory = memory
        self._local = threading.local()  # the current stream, per thread as in CUDA
        self._records = dict.fromkeys(STREAMS, 0)  # events recorded per stream
        self._seen: dict[str, dict[tuple[int, str], int]] = {name: {} for name in STREAMS}  # waited-on events
        self._written: dict[int, tuple[weakref.ref, str, int]] = {}  # id(uploaded tensor) -> (it, stream, seq)
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        return getattr(self._local, "stream", "compute")

    @contextlib.contextmanager
    def stream(self, name: str) -> Iterator[None]:
        if name not in STREAMS:
            raise OrderingError(f"unknown stream {name!r}")
        previous, self._local.stream = self.current, name
        try:
            yield
        finally:
            self._local.stream = previous

    def record(self, name: str) -> SimEvent:
        with self._lock:
            self._records[name] += 1
            return SimEvent(self.index, name, self._records[name])

    def wait(self, name: str, event: Any) -> None:
        if event is None:
            return
        if not isinstance(event, SimEvent):
            raise OrderingError(f"stream {name!r} of device {self.index} waits on {event!r}, which no stream recorded")
        with self._lock:
            seen = self._seen[name]
            key = (event.device, event.stream)
            seen[key] = max(seen.get(key, 0), event.seq)

    def upload(self, host: Tensor) -> Tensor:
        if self.current not in ("upload", "prefetch"):
            raise OrderingError(f"upload on the {self.current!r} stream (uploads go on 'upload' or 'prefetch')")
        out = host.detach().clone()
        with self._lock:
            self._written = {k: v for k, v in self._written.items() if v[0]() is not None}
            self._written[id(out)] = (weakref.ref(out), self.current, self._records[self.current] + 1)
        return out

    def copy_to_host(self, dst: Tensor, src: Tensor) -> None:
        if self.current != "download":
            raise OrderingError(f"copy to the host on the {self.current!r} stream (it goes on 'download')")
        dst.copy_(src)

    def check_ready(self, stream: str, tensors: Iterator[Tensor]) -> None:
        """``stream`` is about to read ``tensors``: each upload must be ordered before it."""
        with self._lock:
            for t in tensors:
                ref, source, seq = self._written.get(id(t), (None, "", 0))
                if ref is not None and ref() is t and source != stream and self._seen[stream].get((self.index, source), 0) < seq:
                    raise OrderingError(f"the {stream!r} stream of device {self.index} reads a tensor uploaded on the "
                                        f"{source!r} stream without waiting for an event recorded after the upload")

    def receive(self, value: Any, event: Any, source: Optional[Device]) -> Any:
        if source is not None and source is not self and event is None:
            raise OrderingError(f"device {self.index} receives a result of device {source.index} without its event")
        self.wait("compute", event)
        return map_tensors(lambda t: t, value)

    def graphs(self, tuning: Tuning) -> StageGraphs:
        return _EagerGraphs(self.torch_device, tuning)

    def memory_cap(self) -> Optional[int]:
        return self.memory


class _EagerGraphs(StageGraphs):
    """StageGraphs' decisions (which input shapes get graphs, the recording limit) with the capture
    and the replays run eagerly: the CPU cannot run CUDA graphs."""

    def _record(self, modules: list[nn.Module], x: Any, call: Callable) -> Any:
        return "captured"

    def _replay(self, rec: Any, modules: list[nn.Module], x: Any, call: Callable) -> Any:
        for layer in modules:
            x = call(layer, x)
        return x
