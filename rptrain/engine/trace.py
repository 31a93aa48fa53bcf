"""A host-side timeline of what the engine does, for benchmarks and debugging.

Off by default (one attribute check per span). ``enable()`` starts recording; ``spans()`` returns
``(name, thread name, start, stop)`` tuples in seconds from ``time.perf_counter``.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

_enabled = False
_spans: list[tuple[str, str, float, float]] = []
_lock = threading.Lock()


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def clear() -> None:
    with _lock:
        _spans.clear()


def spans() -> list[tuple[str, str, float, float]]:
    with _lock:
        return list(_spans)


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    if not _enabled:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        stop = time.perf_counter()
        with _lock:
            _spans.append((name, threading.current_thread().name, start, stop))
