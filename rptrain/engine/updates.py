"""Optimizer -> engine: which piece of the master copy was just updated.

After the optimizer step the engine writes the compute copy from the master: a second pass over
the master weights (13 GB read at 3 B parameters). An optimizer that updates the master in pieces
reports each piece right after its update, and the engine writes that piece of the compute copy
while it is still in cache. rptrain.optim's Adam and AdamW report; other optimizers report nothing
and get the full pass afterwards.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Optional

from torch import Tensor

# listener(piece, version_before): ``piece`` was just updated in place; ``version_before`` is its
# autograd version counter read just before the update (it tells the engine whether anything else
# wrote to the master since the last piece).
Listener = Callable[[Tensor, int], None]
_local = threading.local()


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    previous = getattr(_local, "listener", None)
    _local.listener = listener
    try:
        yield
    finally:
        _local.listener = previous


def listener() -> Optional[Listener]:
    """The listener of the running optimizer step in this thread, if any."""
    return getattr(_local, "listener", None)
