"""``OptimizerCtx``: inside it, engines' ``parameters()`` give the master parameters an optimizer must own.

Step functions run inside it on the optimizer thread (versions.py). The depth is per thread.
"""
from __future__ import annotations

import threading
from typing import Any

_optimizer_ctx = threading.local()


class OptimizerCtx:
    """Inside this block ``RoundPipe.parameters()`` yields the master parameters an optimizer must own."""

    def __enter__(self) -> "OptimizerCtx":
        _optimizer_ctx.depth = getattr(_optimizer_ctx, "depth", 0) + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _optimizer_ctx.depth -= 1


def in_optimizer_ctx() -> bool:
    return getattr(_optimizer_ctx, "depth", 0) > 0
