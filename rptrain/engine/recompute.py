"""Data a layer keeps from its forward for its recompute (the original library's API).

Backward stages run layers forward a second time. A layer whose forward makes a data-dependent
choice (MoE routing, ``nonzero`` masks, a branch taken on a value) can keep it::

    if doing_recompute():
        (mask,) = get_recompute_data()
    else:
        mask = torch.nonzero(x > 0)
        save_for_recompute(mask)

The executor opens a context around every layer call: saving where a recompute will follow,
reading while recomputing, nothing elsewhere (inference, the fused last stage).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional

from torch import Tensor

_local = threading.local()


@contextlib.contextmanager
def layer_call(store: Optional[dict], key: Any, recomputing: bool) -> Iterator[None]:
    """Around one layer call: ``store`` keeps what it saves under ``key`` (None: saving is off)."""
    previous = getattr(_local, "call", None)
    _local.call = (store, key, recomputing)
    try:
        yield
    finally:
        _local.call = previous


def save_for_recompute(*data: Any) -> None:
    """Keep ``data`` for this layer's recompute; a no-op where no recompute follows."""
    store, key, recomputing = getattr(_local, "call", None) or (None, None, False)
    if store is None or recomputing:
        return
    if key in store:
        raise RuntimeError("save_for_recompute() may be called once per layer forward")
    if any(isinstance(t, Tensor) and t.requires_grad for t in data):
        raise ValueError("save_for_recompute(): saved tensors must not require grad (detach them)")
    store[key] = data


def doing_recompute() -> bool:
    """True while a backward stage runs a layer's forward again."""
    call = getattr(_local, "call", None)
    return call is not None and call[2]


def get_recompute_data() -> tuple:
    """What the layer's forward passed to ``save_for_recompute`` (always a tuple)."""
    assert doing_recompute(), "get_recompute_data() can only be called while recomputing (see doing_recompute())"
    store, key, _ = _local.call
    if store is None or key not in store:
        raise RuntimeError("get_recompute_data(): this layer's forward saved nothing (call save_for_recompute there)")
    return store[key]
