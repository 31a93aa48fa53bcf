"""Splitting a batch into microbatches and merging per-microbatch outputs back (pure functions).

Tensors are split along dim 0 when their first dimension equals the batch size; everything else
(non-tensors, 0-dim tensors, tensors of another length) is handed to every microbatch unchanged.
Splits are balanced: sizes differ by at most one, larger ones first.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor


def iter_tensors(obj: Any) -> Iterator[Tensor]:
    """Every tensor inside a nested tuple/list/dict structure, in a fixed order."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)


def map_tensors(fn: Callable[[Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor, keeping the container structure (named tuples included)."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(fn, item) for item in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, item) for item in obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(fn, v)) for k, v in obj.items())
    return obj


def batch_size_of(obj: Any, what: str) -> int:
    for t in iter_tensors(obj):
        if t.dim() >= 1:
            return t.shape[0]
    raise ValueError(f"{what} contains no tensor with a batch dimension; pass split_input/split_label to split it yourself")


def split_sizes(batch: int, n: int) -> list[int]:
    base, extra = divmod(batch, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def _split(obj: Any, batch: int, n: int) -> list[Any]:
    if isinstance(obj, Tensor):
        if obj.dim() >= 1 and obj.shape[0] == batch:
            return list(torch.split(obj, split_sizes(batch, n)))
        return [obj] * n
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        parts = [_split(item, batch, n) for item in obj]
        return [type(obj)(*(p[i] for p in parts)) for i in range(n)]
    if isinstance(obj, (tuple, list)):
        parts = [_split(item, batch, n) for item in obj]
        return [type(obj)(p[i] for p in parts) for i in range(n)]
    if isinstance(obj, dict):
        parts = {k: _split(v, batch, n) for k, v in obj.items()}
        return [type(obj)((k, parts[k][i]) for k in obj) for i in range(n)]
    return [obj] * n


def check_microbatches(batch: int, n: int, what: str) -> None:
    if batch == 0:
        raise ValueError(f"{what} is empty (batch size 0)")
    if n > batch:
        raise ValueError(f"RoundPipeRunConfig.num_microbatch={n} is larger than the batch size {batch}; use 1..{batch}")


def split_inputs(args: tuple, kwargs: dict, n: int, custom: Optional[Callable] = None) -> list[tuple[tuple, dict]]:
    if custom is not None:
        parts = list(custom(args, kwargs, n))
        if len(parts) != n:
            raise ValueError(f"split_input returned {len(parts)} microbatches, expected num_microbatch={n}")
        return [(tuple(a), dict(k)) for a, k in parts]
    batch = batch_size_of((args, kwargs), "the input")
    check_microbatches(batch, n, "the input")
    split_args = _split(tuple(args), batch, n)
    split_kwargs = _split(dict(kwargs), batch, n)
    return list(zip(split_args, split_kwargs))


def split_label(label: Any, n: int, custom: Optional[Callable] = None) -> list[Any]:
    if custom is not None:
        parts = list(custom(label, n))
        if len(parts) != n:
            raise ValueError(f"split_label returned {len(parts)} microbatches, expected num_microbatch={n}")
        return parts
    if label is None:
        return [None] * n
    tensors = [t for t in iter_tensors(label) if t.dim() >= 1]
    if not tensors:
        return [label] * n
    batch = tensors[0].shape[0]
    check_microbatches(batch, n, "the label")
    return _split(label, batch, n)


def merge_outputs(outputs: list[Any], custom: Optional[Callable] = None) -> Any:
    """Concatenate per-microbatch outputs along dim 0 (0-dim tensors are stacked)."""
    if custom is not None:
        return custom(outputs)
    first = outputs[0]
    if isinstance(first, Tensor):
        return torch.cat(outputs) if first.dim() >= 1 else torch.stack(outputs)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(merge_outputs([o[i] for o in outputs]) for i in range(len(first))))
    if isinstance(first, (tuple, list)):
        return type(first)(merge_outputs([o[i] for o in outputs]) for i in range(len(first)))
    if isinstance(first, dict):
        return type(first)((k, merge_outputs([o[k] for o in outputs])) for k in first)
    return list(outputs)
