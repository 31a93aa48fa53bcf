"""What a whole call's recording depends on in its ``loss_fn`` (wholecall.py keys its recordings by it).

A ``loss_fn`` is keyed by its code and what it closes over: numbers and strings by value, other
objects by identity (the tutorial's ``lambda out, y: scaler.scale(criterion(out, y))`` is a new
function object every call, the same key). Globals it reads are assumed constant. A ``loss_fn`` that
changes a list, dict or set it closes over has side effects a replay would not repeat:
``closure_kept`` puts them back and raises ``SideEffects``.
"""
from __future__ import annotations

import contextlib
import copy
import types
from typing import Any, Callable, Iterator

import torch

_VALUES = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


def _value_key(v: Any, depth: int = 0) -> Any:
    """Numbers and strings by value, containers of them by their items, anything else by identity."""
    if isinstance(v, _VALUES):
        return ("v", type(v), v)
    if isinstance(v, (tuple, list)) and depth < 3:
        return ("s", type(v), tuple(_value_key(x, depth + 1) for x in v))
    return ("id", id(v))


def _cells(fn: Callable) -> list:
    out = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # a cell not yet assigned
            out.append(_EMPTY)
    return out


_EMPTY = object()


def loss_key(fn: Callable) -> tuple:
    """What a recording of ``fn`` depends on (its identity where it has no code of its own)."""
    if isinstance(fn, types.MethodType):
        return ("method", id(fn.__self__), loss_key(fn.__func__))
    if hasattr(fn, "func") and hasattr(fn, "args") and hasattr(fn, "keywords"):  # functools.partial
        return ("partial", loss_key(fn.func), _value_key(fn.args), tuple(sorted((k, _value_key(v)) for k, v in fn.keywords.items())))
    code = getattr(fn, "__code__", None)
    if code is None:  # a callable object, e.g. nn.CrossEntropyLoss(): its tensors are read from their memory
        return ("object", id(fn))
    cells = tuple(_value_key(v) for v in _cells(fn))
    return ("code", code, cells, _value_key(fn.__defaults__), _value_key(sorted((fn.__kwdefaults__ or {}).items())))


def _identities(container: Any) -> Any:
    items = container.items() if isinstance(container, dict) else container
    return [tuple(map(id, kv)) if isinstance(container, dict) else id(kv) for kv in items]


@contextlib.contextmanager
def closure_kept(fn: Callable) -> Iterator[None]:
    """Run recordings with the lists, dicts and sets ``fn`` closes over put back afterwards; raise if one
    changed. Such a ``loss_fn`` has side effects (say, it appends a count per microbatch) that a replay,
    which never calls it, would not have: the call runs stage by stage instead."""
    containers = [v for v in _cells(fn) if isinstance(v, (list, dict, set))]
    saved = [(copy.copy(c), _identities(c)) for c in containers]
    changed = False
    try:
        yield
    finally:
        for c, (before, ids) in zip(containers, saved):
            if _identities(c) != ids:
                changed = True
                c.clear()
                if isinstance(c, list):
                    c.extend(before)
                else:
                    c.update(before)
    if changed:
        raise SideEffects("loss_fn changes a list, dict or set it closes over, which a replayed graph would not do")


class SideEffects(Exception):
    pass
