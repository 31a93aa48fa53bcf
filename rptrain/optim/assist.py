"""A host run's low-precision step, partly streamed through a GPU that would otherwise wait.

With one version of the weights every step is synchronous: while the host steps its share, the GPU has
nothing to do. Qwen3-32B's shape on the H200 (gpu_suite split-big, 2026-12-06): 5.4 s of a 14.3 s step
was the host stepping 18.3 B parameters on 16 cores (0.30 ns each), the GPU idle. A GPU steps a chunk far
faster than PCIe brings it, so here the first ``share`` of a host run goes up in chunks (master, gradient,
moments: about 6 bytes a parameter with bf16 and 8-bit state, 0.12 ns at 50 GB/s), is stepped by the GPU
share's own kernel, and comes back (4 bytes), while the host steps the rest; both parts end about together
when ``share`` balances the two speeds (``Tuning.host_step_gpu_share``).

The result does not depend on the split: every element's random bits are those of its index in the whole
run (the kernels' ``start``), and the GPU kernel is adam_lowp.py's formulas; the host's C++ loop agrees
with them to rounding (cpu_kernel.py). Chunks go through a fixed number of slots on the GPU (``SLOTS``), so
the GPU memory it takes is bounded whatever the run's size; the step comes after the call, whose activation
memory is free by then. Host tensors that are not pinned still work, at the speed of staged copies: a run's
state made while assisting is pinned (flat.py).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from . import front
from ..thread_setting import setting
from .lowbit import BLOCK

SLOTS = 3  # chunks in flight: one uploading, one stepping, one downloading
_local = threading.local()
_STREAMS: dict[torch.device, tuple] = {}
_STREAMS_LOCK = threading.Lock()


@dataclass(frozen=True)
class Assist:
    device: torch.device
    share: float  # of each host run's elements, stepped on ``device``
    chunk: int = 1 << 25  # elements a transfer (32 M: about 200 MB of bf16 master, gradient and 8-bit moments)

    def gpu_part(self, numel: int) -> int:
        """Elements ``[0, n)`` of a run of ``numel`` that go through the GPU: whole blocks, so the host's
        part starts on a block (8-bit moments keep a scale per block)."""
        return int(numel * min(max(self.share, 0.0), 1.0)) // BLOCK * BLOCK


def assisting(assist: Optional[Assist]) -> contextlib.AbstractContextManager:
    """Host runs stepped inside take ``assist`` (the engine wraps a synchronous step in it)."""
    return setting(_local, "assist", assist)


def current() -> Optional[Assist]:
    return getattr(_local, "assist", None)


def _piece(t: Tensor, a: int, b: int, per_block: bool) -> Tensor:
    return t[a // BLOCK : -(-b // BLOCK)] if per_block else t[a:b]


def _streams(device: torch.device) -> tuple:
    with _STREAMS_LOCK:
        if device not in _STREAMS:
            _STREAMS[device] = tuple(torch.cuda.Stream(device) for _ in range(3))
        return _STREAMS[device]


def stream_through(assist: Assist, host: dict[str, Tensor], stop: int, step_piece: Callable[[dict[str, Tensor], int], None],
                   read_only: tuple[str, ...] = ("grad",)) -> Callable[[], None]:
    """Queue the step of elements ``[0, stop)``: each chunk's pieces of ``host`` (flat tensors by name;
    names ending in ``_scale`` hold one value per block) go up, ``step_piece(pieces, start)`` steps them on
    the GPU, and all but ``read_only`` come back. Returns the wait for the last copy home."""
    device = assist.device
    blocks = {name: name.endswith("_scale") for name in host}
    chunks = [(a, min(a + assist.chunk, stop)) for a in range(0, stop, assist.chunk)]
    if device.type != "cuda":  # (tests: the same pieces and order, one after another)
        for a, b in chunks:
            pieces = {name: _piece(t, a, b, blocks[name]).to(device, copy=True) for name, t in host.items()}
            step_piece(pieces, a)
            for name, t in host.items():
                if name not in read_only:
                    _piece(t, a, b, blocks[name]).copy_(pieces[name])
                    front.report(_piece(t, a, b, blocks[name]))
        return lambda: None
    up, work, down = _streams(device)
    caller = torch.cuda.current_stream(device)
    up.wait_stream(caller)  # after what the step's stream has queued before (nothing reads these tensors there)
    slots = [{name: torch.empty(-(-assist.chunk // BLOCK) if blocks[name] else assist.chunk, dtype=t.dtype, device=device)
              for name, t in host.items()} for _ in range(min(SLOTS, len(chunks)))]
    freed: list[Optional[torch.cuda.Event]] = [None] * len(slots)
    for i, (a, b) in enumerate(chunks):
        k = i % len(slots)
        pieces = {name: buf[: _piece(host[name], a, b, blocks[name]).numel()] for name, buf in slots[k].items()}
        with torch.cuda.stream(up):
            if freed[k] is not None:
                up.wait_event(freed[k])  # the slot's last chunk is home
            for name, t in host.items():
                pieces[name].copy_(_piece(t, a, b, blocks[name]), non_blocking=True)
        work.wait_event(up.record_event())
        with torch.cuda.stream(work):
            step_piece(pieces, a)
        down.wait_event(work.record_event())
        with torch.cuda.stream(down):
            for name, t in host.items():
                if name not in read_only:
                    _piece(t, a, b, blocks[name]).copy_(pieces[name], non_blocking=True)
        freed[k] = down.record_event()
        for name, t in host.items():  # a call overlapping this step reads the chunk once it is home (front.py)
            if name not in read_only:
                front.report(_piece(t, a, b, blocks[name]), freed[k])
    end = down.record_event()
    caller.wait_event(end)

    def wait() -> None:
        end.synchronize()
        slots.clear()  # every stream that used them is done: the memory may go back to the allocator

    return wait
