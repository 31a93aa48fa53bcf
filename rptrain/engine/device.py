"""The device interface the executor runs on: four streams, events, copies, RNG state and timers.

``CudaDevice`` overlaps uploads, compute and downloads on separate CUDA streams ordered by events;
the optimizer thread stages the next weights on a fourth, so that upload never queues ahead of a
running call's.
``CpuDevice`` runs the same calls inline: its streams are no-ops, its events are always complete
and its "uploads" hand back the host tensor itself, so the executor's logic runs unchanged in CI.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
from torch import Tensor

from . import rng
from .batching import map_tensors
from .graphs import StageGraphs
from .tuning import Tuning

if TYPE_CHECKING:
    from .wholecall import WholeCallGraphs

STREAMS = ("compute", "upload", "download", "prefetch")


class _DoneEvent:
    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Device:
    """One worker. ``index`` is its place in the engine's device list."""

    is_cuda = False
    pins_memory = False  # host memory this device copies from is pinned (page-locked)

    def __init__(self, index: int, torch_device: torch.device):
        self.index = index
        self.torch_device = torch_device

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.torch_device})"

    def stream(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def record(self, name: str) -> Any:
        return _DoneEvent()

    def wait(self, name: str, event: Any) -> None:
        pass

    def upload(self, host: Tensor) -> Tensor:
        """Bring a host tensor here; call inside ``stream("upload")``. On the CPU it is the same tensor."""
        return host

    def copy_to_host(self, dst: Tensor, src: Tensor) -> None:
        """Copy ``src`` into the host tensor ``dst``; call inside ``stream("download")``."""
        dst.copy_(src)

    def follow_caller(self, stream: str = "compute") -> None:
        """Order ``stream``'s next work after what the calling thread queued on its current stream
        (for a call: inputs and labels it made on this GPU, e.g. augmentation; for a version's staging:
        the step that wrote the master)."""

    def join_caller(self) -> Any:
        """The end of a call whose results nobody reads on the host: order the caller's later work after
        the call's without waiting for it. Returns what ``stepping`` needs to order a step after the call."""
        self.synchronize()
        return None

    def stepping(self, ended: Any) -> contextlib.AbstractContextManager:
        """Where the optimizer thread steps the gradients of a call that ended with ``join_caller``:
        after that call, not after the calls the caller has issued since."""
        return contextlib.nullcontext()

    def step_event(self) -> Any:
        """Marks the step work issued so far on the current stream (None: it is done already)."""
        return None

    def follow_step(self, event: Any) -> None:
        """Order this device's streams after a step's ``step_event``: the next call's writes of the
        gradient buffer the step read, and its reads of the master the step wrote."""

    def settle_steps(self) -> None:
        """Wait for the steps queued on the optimizer threads' stream (before the host reads the master)."""

    def receive(self, value: Any, event: Any, source: Optional["Device"]) -> Any:
        """Make tensors produced on ``source`` (None: the host) usable on this device's compute stream."""
        return map_tensors(lambda t: t.to(self.torch_device), value)

    def check_ready(self, stream: str, tensors: Iterator[Tensor]) -> None:
        """``stream`` is about to read ``tensors``; a device that tracks order checks it (simulated.py)."""

    def graphs(self, tuning: Tuning) -> StageGraphs:
        """Where this device records and replays CUDA graphs."""
        return StageGraphs(self.torch_device, tuning)

    def whole_call_graphs(self, tuning: Tuning) -> "WholeCallGraphs":
        """Where this device records and replays whole training calls as CUDA graphs (wholecall.py)."""
        from .wholecall import WholeCallGraphs  # imported here: it imports the compute functions, which import this module

        return WholeCallGraphs(self.torch_device, tuning)

    def keep_alive(self, tensor: Tensor, stream: str) -> None:
        """Tell the allocator ``tensor`` is used on ``stream`` so its memory is not reused too early."""

    def zeros(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.torch_device)

    def rng_state(self) -> Tensor:
        return rng.get_state(torch.device("cpu"))

    @contextlib.contextmanager
    def replay_rng(self, state: Optional[Tensor]) -> Iterator[None]:
        """Run the block from ``state`` and leave the generator as it was before."""
        if state is None:
            yield
            return
        saved = self.rng_state()
        self._set_rng_state(state)
        try:
            yield
        finally:
            self._set_rng_state(saved)

    def _set_rng_state(self, state: Tensor) -> None:
        rng.set_state(state, torch.device("cpu"))

    def timer(self) -> Any:
        return time.perf_counter()

    def elapsed(self, start: Any, stop: Any) -> float:
        """Seconds between two ``timer()`` marks; valid after ``synchronize()``."""
        return stop - start

    def synchronize(self) -> None:
        pass

    def memory_cap(self) -> Optional[int]:
        return None

    def free_memory(self) -> int:
        """Bytes free on the device now (fit.py budgets GPU memory with it)."""
        return 0


class CpuDevice(Device):
    def __init__(self, index: int = 0):
        super().__init__(index, torch.device("cpu"))


# The optimizer threads' streams, by GPU index: a step's GPU work waits for the calls it steps (stepping).
_STEP_STREAMS: dict[int, "torch.cuda.Stream"] = {}
_STEP_STREAMS_LOCK = threading.Lock()


class CudaDevice(Device):
    is_cuda = True
    pins_memory = True

    def __init__(self, index: int, cuda_index: int):
        super().__init__(index, torch.device("cuda", cuda_index))
        with torch.cuda.device(self.torch_device):
            self.streams = {name: torch.cuda.Stream() for name in STREAMS}

    def stream(self, name: str) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.streams[name])

    def record(self, name: str) -> torch.cuda.Event:
        return self.streams[name].record_event()

    def wait(self, name: str, event: Any) -> None:
        if isinstance(event, torch.cuda.Event):
            self.streams[name].wait_event(event)

    def upload(self, host: Tensor) -> Tensor:
        return host.to(self.torch_device, non_blocking=True)

    def copy_to_host(self, dst: Tensor, src: Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def follow_caller(self, stream: str = "compute") -> None:
        self.streams[stream].wait_stream(torch.cuda.current_stream(self.torch_device))

    def join_caller(self) -> Any:
        ended = [stream.record_event() for stream in self.streams.values()]
        caller = torch.cuda.current_stream(self.torch_device)
        for event in ended:
            caller.wait_event(event)
        return ended

    def stepping(self, ended: Any) -> contextlib.AbstractContextManager:
        if not ended:
            return contextlib.nullcontext()
        with _STEP_STREAMS_LOCK:  # one per GPU, shared by engines: wrap_model's one step nests every engine's context
            stream = _STEP_STREAMS.get(self.torch_device.index)
            if stream is None:
                stream = _STEP_STREAMS[self.torch_device.index] = torch.cuda.Stream(self.torch_device)
        for event in ended:
            stream.wait_event(event)
        return torch.cuda.stream(stream)

    def step_event(self) -> Any:
        return torch.cuda.current_stream(self.torch_device).record_event()

    def follow_step(self, event: Any) -> None:
        if event is not None:
            for stream in self.streams.values():
                stream.wait_event(event)

    def settle_steps(self) -> None:
        stream = _STEP_STREAMS.get(self.torch_device.index)
        if stream is not None:
            stream.synchronize()

    def receive(self, value: Any, event: Any, source: Optional[Device]) -> Any:
        if source is self:
            return value  # same compute stream: already ordered
        compute = self.streams["compute"]

        def move(t: Tensor) -> Tensor:
            if t.device == self.torch_device:
                self.wait("compute", event)
                t.record_stream(compute)
                return t
            if t.device.type == "cuda":
                # The peer copy runs on the source device's current stream: order it after the producer.
                src_stream = torch.cuda.current_stream(t.device)
                if isinstance(event, torch.cuda.Event):
                    src_stream.wait_event(event)
                moved = t.to(self.torch_device, non_blocking=True)
                t.record_stream(src_stream)
                return moved
            self.wait("compute", event)  # e.g. an activation still being offloaded to the host
            if not t.is_pinned():
                t = t.pin_memory()
            return t.to(self.torch_device, non_blocking=True)

        with torch.cuda.stream(compute):
            return map_tensors(move, value)

    def check_ready(self, stream: str, tensors: Iterator[Tensor]) -> None:
        """``stream`` is about to read ``tensors``; a device that tracks order checks it (simulated.py)."""

    def graphs(self, tuning: Tuning) -> StageGraphs:
        """Where this device records and replays CUDA graphs."""
        return StageGraphs(self.torch_device, tuning)

    def keep_alive(self, tensor: Tensor, stream: str) -> None:
        tensor.record_stream(self.streams[stream])

    def rng_state(self) -> Tensor:
        return rng.get_state(self.torch_device)

    def _set_rng_state(self, state: Tensor) -> None:
        rng.set_state(state, self.torch_device)

    def timer(self) -> Any:
        return self.streams["compute"].record_event(torch.cuda.Event(enable_timing=True))

    def elapsed(self, start: Any, stop: Any) -> float:
        return start.elapsed_time(stop) / 1000.0

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def free_memory(self) -> int:
        return torch.cuda.mem_get_info(self.torch_device)[0]

    def memory_cap(self) -> Optional[int]:
        free, _ = torch.cuda.mem_get_info(self.torch_device)
        return int(0.85 * (free + torch.cuda.memory_reserved(self.torch_device)))


def resolved(device: torch.device) -> torch.device:
    """``cuda`` without an index is the current GPU, as the tensors made there say."""
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None else device


def make_devices(spec: Any = None) -> list[Device]:
    """``None``: every visible GPU, else the CPU. Or a list such as ``["cuda:0", "cuda:1"]`` or
    ``["cpu", "cpu"]`` (several CPU workers exercise the multi-device schedule without a GPU)."""
    if spec is None:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            spec = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        else:
            spec = ["cpu"]
    if isinstance(spec, (str, torch.device)):
        spec = [spec]
    devices: list[Device] = []
    for i, item in enumerate(spec):
        if isinstance(item, Device):  # e.g. a simulated GPU (simulated.py); its index is its place here
            item.index = i
            devices.append(item)
            continue
        dev = torch.device(item)
        if dev.type == "cpu":
            devices.append(CpuDevice(i))
        elif dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {item!r} requested but CUDA is not available")
            devices.append(CudaDevice(i, resolved(dev).index))
        else:
            raise ValueError(f"unsupported device {item!r}: use 'cpu' or 'cuda[:N]'")
    if not devices:
        raise ValueError("devices must name at least one device")
    if len({d.is_cuda for d in devices}) > 1:
        raise ValueError("devices must be all CPU or all CUDA")
    return devices
