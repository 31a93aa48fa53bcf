"""A simulated GPU for tests: runs on the CPU but takes every CUDA code path of the engine.

``SimulatedDevice`` says ``is_cuda`` like a ``CudaDevice``, so the engine keeps weights resident,
prefetches the next stage, plans CUDA graphs, offloads activations and sends gradients early exactly
as on a GPU; its tensors are CPU tensors. Streams and events become ordering checks instead of
hardware queues:

- an event waited on must have been recorded (on this device or another one);
- an upload happens on the upload or prefetch stream, a copy home on the download stream;
- a tensor written on one stream (an upload, a zeroed gradient tensor) and read on another (the
  compute stream binding a stage, ``check_ready``; the download stream copying it home) needs the
  reader to be ordered after it: each stream keeps a clock of the events it has waited on, directly
  or through other events (happens-before, as CUDA orders streams).

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
from torch.utils import _pytree as pytree

from .batching import map_tensors
from .device import STREAMS, Device
from .graphs import StageGraphs
from .tuning import Tuning
from .wholecall import Recorded, Replayed, WholeCallGraphs, fill_scales, run_call


class OrderingError(RuntimeError):
    """Work on one simulated stream used a result of another without waiting for it."""


Clock = dict  # (device index, stream) -> how many events of that stream are ordered before this point


class SimEvent:
    """What ``record`` returns: the recording stream's clock (every event ordered before it)."""

    def __init__(self, clock: Clock):
        self.clock = clock

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
        self._clocks: dict[str, Clock] = {name: {} for name in STREAMS}  # what each stream is ordered after
        self._written: dict[int, tuple[weakref.ref, tuple[int, str], int]] = {}  # id(tensor) -> (it, writer, event)
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
            clock, key = self._clocks[name], (self.index, name)
            clock[key] = clock.get(key, 0) + 1
            return SimEvent(dict(clock))

    def wait(self, name: str, event: Any) -> None:
        if event is None:
            return
        if not isinstance(event, SimEvent):
            raise OrderingError(f"stream {name!r} of device {self.index} waits on {event!r}, which no stream recorded")
        with self._lock:
            clock = self._clocks[name]
            for key, count in event.clock.items():
                clock[key] = max(clock.get(key, 0), count)

    def _written_here(self, t: Tensor) -> Tensor:
        """Remember that the current stream writes ``t``: readers on other streams must wait on its next event."""
        key = (self.index, self.current)
        with self._lock:
            ident = id(t)
            ref = weakref.ref(t, lambda _, ident=ident: self._written.pop(ident, None))
            self._written[ident] = (ref, key, self._clocks[self.current].get(key, 0) + 1)
        return t

    def upload(self, host: Tensor) -> Tensor:
        if self.current not in ("upload", "prefetch"):
            raise OrderingError(f"upload on the {self.current!r} stream (uploads go on 'upload' or 'prefetch')")
        return self._written_here(host.detach().clone())

    def zeros(self, numel: int, dtype: torch.dtype) -> Tensor:
        return self._written_here(super().zeros(numel, dtype))

    def copy_to_host(self, dst: Tensor, src: Tensor) -> None:
        if self.current != "download":
            raise OrderingError(f"copy to the host on the {self.current!r} stream (it goes on 'download')")
        self.check_ready("download", [src])
        dst.copy_(src)

    def check_ready(self, stream: str, tensors: Iterator[Tensor]) -> None:
        """``stream`` is about to read ``tensors`` (or views of them): their writes must be ordered before it."""
        with self._lock:
            for t in tensors:
                base = t if t._base is None else t._base
                ref, writer, seq = self._written.get(id(base), (None, (self.index, stream), 0))
                if ref is not None and ref() is base and writer != (self.index, stream) and self._clocks[stream].get(writer, 0) < seq:
                    raise OrderingError(f"the {stream!r} stream of device {self.index} reads a tensor written on the "
                                        f"{writer[1]!r} stream without waiting for an event recorded after the write")

    def receive(self, value: Any, event: Any, source: Optional[Device]) -> Any:
        if source is not None and source is not self and event is None:
            raise OrderingError(f"device {self.index} receives a result of device {source.index} without its event")
        self.wait("compute", event)
        return map_tensors(lambda t: t, value)

    def graphs(self, tuning: Tuning) -> StageGraphs:
        return _EagerGraphs(self.torch_device, tuning)

    def whole_call_graphs(self, tuning: Tuning) -> WholeCallGraphs:
        return _EagerWholeCall(self.torch_device, tuning)

    def memory_cap(self) -> Optional[int]:
        return self.memory

    def free_memory(self) -> int:
        return self.memory


class _EagerGraphs(StageGraphs):
    """StageGraphs' decisions (which input shapes get graphs, the recording limit) with the capture
    and the replays run eagerly: the CPU cannot run CUDA graphs. Like a real replay, each returns
    its outputs in the same memory every time, so a caller keeping them without a copy sees the next
    replay's values (as on a GPU)."""

    def _record(self, modules: list[nn.Module], x: Any, call: Callable, grad: bool = True) -> Any:
        return []  # the static output tensors, made by the first replay (run in the caller's grad mode)

    def _replay(self, rec: Any, modules: list[nn.Module], x: Any, call: Callable) -> Any:
        for layer in modules:
            x = call(layer, x)
        leaves, spec = pytree.tree_flatten(x)
        tensors = [v for v in leaves if isinstance(v, Tensor)]
        if not rec:
            rec.extend(torch.empty_like(t) for t in tensors)
        it = iter(static.detach().copy_(t) for static, t in zip(rec, tensors))  # a fresh autograd history, the same memory
        return pytree.tree_unflatten([next(it) if isinstance(v, Tensor) else v for v in leaves], spec)


class _EagerWholeCall(WholeCallGraphs):
    """WholeCallGraphs' decisions (keys, the recording limit, fallbacks) with each replay run eagerly,
    the scales read from their tensors as a replay reads them; like a real replay it returns the
    losses and outputs in the same memory every time."""

    def _capture(self, layers: list, inputs: list, labels: list, loss_fn: Callable, sizes: Optional[list]) -> Recorded:
        run_call(layers, inputs, labels, loss_fn, {}, {}, self._forward(layers), sizes=sizes)  # the warm-up a recording runs (its effects are put back)
        return Recorded(None, [], [], [], [], {}, keep=loss_fn, sizes=sizes)

    def _replay(self, rec: Recorded, modules: Any, inputs: list, labels: list, loss_fn: Callable) -> Replayed:
        fill_scales(rec)
        registry: dict = {}
        losses, outputs = run_call(modules, inputs, labels, loss_fn, rec.factors, registry, self._forward(list(modules)), sizes=rec.sizes)
        if not rec.losses:
            rec.filled.update(registry)  # the scale tensors were made holding these
            rec.losses = [(single, [t.clone() for t in items]) for single, items in losses]
            rec.outputs = [map_tensors(torch.clone, out) for out in outputs]
        else:
            for (_, static), (_, items) in zip(rec.losses, losses):
                for s, t in zip(static, items):
                    s.copy_(t)
            for static, out in zip(rec.outputs, outputs):
                for s, t in zip(pytree.tree_leaves(static), pytree.tree_leaves(out)):
                    if isinstance(s, Tensor):
                        s.copy_(t)
        return Replayed(rec.losses, rec.outputs, registry)
