"""A value set for the duration of a block, seen only by the thread that set it (a step's assist, its
front, a call's GradScaler registry): what the code run inside reads without taking it as an argument."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator


@contextlib.contextmanager
def setting(local: threading.local, name: str, value: Any) -> Iterator[None]:
    """``getattr(local, name)`` is ``value`` inside the block, and what it was before after it."""
    previous = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, previous)
