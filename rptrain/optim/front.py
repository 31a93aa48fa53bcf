"""How far a running optimizer step has got: the memory it has finished writing, for a reader that starts early.

With one version of the weights a step writes the weights the next call reads. Waiting for the whole step
before that call starts leaves the GPU idle while the host steps its share (Qwen3-32B's shape on the H200:
5.4 s of a 14.3 s step, gpu_suite split-big, 2026-12-06). The next forward reads the layers in order, and
the step writes them in the same order (the GPU share first, then the host runs by offset), so the call
may read a layer as soon as its part of the step is done. The step says what it has done here; the reader
waits for exactly the memory it reads.

Memory is named by address ranges of the tensors written, so nothing here knows the engine's layouts:
a reader of memory nobody reports (a compute copy cast at the step's end, an optimizer that reports
nothing) waits for ``finish``, which the step's owner calls last, also when the step fails. A piece
written by GPU work carries the CUDA event after which it is final: the reader's stream waits for it.
"""
from __future__ import annotations

import bisect
import contextlib
import threading
from typing import Any, Optional

import torch
from torch import Tensor

from ..thread_setting import setting

_local = threading.local()


def _span(t: Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


class StepFront:
    """The memory one step has finished, as disjoint sorted address ranges, and GPU events per piece."""

    def __init__(self, version: int):
        self.version = version
        self._cond = threading.Condition()
        self._starts: list[int] = []  # disjoint, sorted: [starts[i], stops[i]) is done
        self._stops: list[int] = []
        self._events: list[tuple[int, int, Any]] = []  # (start, stop, event): final once the event completes
        self.finished = False

    def done(self, t: Tensor, event: Any = None) -> None:
        """``t``'s memory holds its values for this step (once ``event`` completes, where given)."""
        lo, hi = _span(t)
        if hi <= lo:
            return
        with self._cond:
            if event is not None:
                self._events.append((lo, hi, event))
            i = bisect.bisect_left(self._stops, lo)  # the first range that ends at or after lo: it may touch
            j = bisect.bisect_right(self._starts, hi)  # ranges from i up to j touch [lo, hi): merge them
            if i < j:
                lo, hi = min(lo, self._starts[i]), max(hi, self._stops[j - 1])
            self._starts[i:j], self._stops[i:j] = [lo], [hi]
            self._cond.notify_all()

    def finish(self) -> None:
        """Everything the step writes is written (or it stopped): every reader may go on."""
        with self._cond:
            self.finished = True
            self._cond.notify_all()

    def wait_finished(self) -> None:
        with self._cond:
            while not self.finished:
                self._cond.wait(timeout=1.0)

    def _covered(self, lo: int, hi: int) -> bool:
        i = bisect.bisect_right(self._starts, lo) - 1
        return i >= 0 and self._stops[i] >= hi

    def wait(self, t: Tensor) -> list[Any]:
        """Block until ``t``'s memory is done; the GPU events the reader's stream must wait for."""
        lo, hi = _span(t)
        with self._cond:
            while not self.finished and not self._covered(lo, hi):
                self._cond.wait(timeout=1.0)
            return [e for a, b, e in self._events if a < hi and lo < b]


def tracking(front: Optional[StepFront]) -> contextlib.AbstractContextManager:
    """Steps run inside report what they finish to ``front``."""
    return setting(_local, "front", front)


def current() -> Optional[StepFront]:
    return getattr(_local, "front", None)


def report(t: Tensor, event: Any = None) -> None:
    """The step running on this thread finished ``t`` (GPU work: after the current stream's work so far,
    or after ``event``)."""
    front = current()
    if front is None:
        return
    if event is None and t.is_cuda:
        event = torch.cuda.current_stream(t.device).record_event()
    front.done(t, event)
