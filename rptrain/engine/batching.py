"""Splitting a batch into microbatches and merging per-microbatch outputs back (pure functions).

Structures are walked with torch's pytree: tuples, lists, dicts, named tuples and every type
registered with ``torch.utils._pytree.register_pytree_node`` (transformers' ``ModelOutput``
included) are opened; anything else is a leaf.

Automatic splitting, per leaf: a tensor whose first dimension is the batch size is split along
dim 0 (balanced: sizes differ by at most one, larger ones first); everything else is handed to
every microbatch. A ``PackedData`` leaf (an earlier call's output with ``merge_output=False``)
gives microbatch i its entry i, and its sizes set the split of the other leaves.

Automatic merging, per leaf: tensors with dimensions are concatenated along dim 0, 0-dim floating
tensors are averaged, anything else must be equal in every microbatch and comes back once.

Specs, as in ``torch.distributed.pipelining.microbatch``: ``TensorChunkSpec(dim)`` (split or
concatenate along ``dim``), ``_Replicate`` (the same value for every microbatch / the first one
back), ``_CustomReducer(init, fn)`` (merge by ``functools.reduce``), given as a structure matching
the value (a prefix of it will do). ``split_input`` takes ``(args_spec, kwargs_spec)``, either
None for automatic.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor
from torch.utils import _pytree as pytree


class PackedData(list):
    """One output leaf's per-microbatch values (``merge_output=False``)."""

    def synchronize(self) -> "PackedData":
        """The original library waits for copies here; rptrain's calls return with them done."""
        return self


# Tensors and plain containers skip pytree's walk: the common case on every call's hot path (pytree's
# tree_map and unflatten were 1.1 ms a ResNet-34 step on the H200 host, cProfile).
def _plain(obj: Any) -> bool:
    """A container pytree opens the same way a loop does: tuple, list, dict, namedtuple."""
    t = type(obj)
    return t in (tuple, list, dict) or (issubclass(t, tuple) and hasattr(t, "_fields"))


def iter_tensors(obj: Any) -> Iterator[Tensor]:
    """Every tensor inside a pytree, in a fixed order."""
    if isinstance(obj, Tensor):
        return iter((obj,))
    if _plain(obj):
        return (t for x in (obj.values() if isinstance(obj, dict) else obj) for t in iter_tensors(x))
    return (leaf for leaf in pytree.tree_leaves(obj) if isinstance(leaf, Tensor))


def map_tensors(fn: Callable[[Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor, keeping the structure."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if _plain(obj):  # the same walk as pytree's, 20x faster for a pair of tensors
        if isinstance(obj, dict):
            return {k: map_tensors(fn, v) for k, v in obj.items()}
        mapped = [map_tensors(fn, x) for x in obj]
        return type(obj)(*mapped) if hasattr(obj, "_fields") else type(obj)(mapped)
    return pytree.tree_map(lambda leaf: fn(leaf) if isinstance(leaf, Tensor) else leaf, obj)


def opaque_type(obj: Any) -> Optional[type]:
    """The type of a leaf that holds tensors pytree cannot see (an unregistered class), if any."""
    for leaf in pytree.tree_leaves(obj):
        if not isinstance(leaf, (Tensor, PackedData)) and any(isinstance(v, Tensor) for v in getattr(leaf, "__dict__", {}).values()):
            return type(leaf)
    return None


def split_sizes(batch: int, n: int) -> list[int]:
    base, extra = divmod(batch, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def check_microbatches(batch: int, n: int, what: str) -> None:
    if batch == 0:
        raise ValueError(f"{what} is empty (batch size 0)")
    if n > batch:
        raise ValueError(f"RoundPipeRunConfig.num_microbatch={n} is larger than the batch size {batch}; use 1..{batch}")


class _Never:
    """Stands for the spec classes while their module is not imported: then no spec can hold them."""


def _markers() -> tuple[type, type, type]:
    # Importing torch.distributed.pipelining takes seconds: a spec's author has imported it already.
    module = sys.modules.get("torch.distributed.pipelining.microbatch")
    if module is None:
        return _Never, _Never, _Never
    return module.TensorChunkSpec, module._Replicate, module._CustomReducer


def is_function(spec: Any) -> bool:
    """A user function (not a spec marker: ``_Replicate`` is a class, so callable too)."""
    return callable(spec) and not isinstance(spec, (type, *_markers()))


class _Reduce:
    """Hides a ``_CustomReducer`` (a named tuple, which pytree would open) as one spec leaf."""

    def __init__(self, reducer: Any):
        self.reducer = reducer


def _spec_leaves(spec: Any, treespec: pytree.TreeSpec, what: str) -> list:
    if spec is None:
        return [None] * treespec.num_leaves
    reducer = _markers()[2]
    spec = pytree.tree_map(lambda s: _Reduce(s) if isinstance(s, reducer) else s, spec, is_leaf=lambda s: isinstance(s, reducer))
    leaves = pytree._broadcast_to_and_flatten(spec, treespec)
    if leaves is None:
        raise ValueError(f"RoundPipeRunConfig.{what} spec {spec!r} does not match the structure {treespec}")
    return leaves


# ------------------------------------------------------------------------------------------- split
def _auto_sizes(leaves: list, specs: list, n: int, what: str) -> Optional[list[int]]:
    """Microbatch sizes: a packed leaf's, else balanced over the first batched auto-split tensor."""
    for leaf in leaves:
        if isinstance(leaf, PackedData):
            if len(leaf) != n:
                raise ValueError(f"{what} holds packed data of {len(leaf)} microbatches, but num_microbatch={n}")
            return [next((t.shape[0] for t in iter_tensors(v) if t.dim()), 0) for v in leaf]
    for leaf, spec in zip(leaves, specs):
        if spec is None and isinstance(leaf, Tensor) and leaf.dim() >= 1:
            check_microbatches(leaf.shape[0], n, what)
            return split_sizes(leaf.shape[0], n)
    return None


def _chunks(leaf: Any, spec: Any, sizes: Optional[list[int]], n: int, what: str) -> list:
    chunk_spec, replicate, _ = _markers()
    if isinstance(leaf, PackedData):
        return list(leaf)
    if spec is replicate or isinstance(spec, replicate):
        return [leaf] * n
    if isinstance(spec, chunk_spec):
        if not isinstance(leaf, Tensor):
            raise TypeError(f"{what}: TensorChunkSpec({spec.split_dim}) given for a {type(leaf).__name__}, not a tensor")
        check_microbatches(leaf.shape[spec.split_dim], n, what)
        return list(torch.split(leaf, split_sizes(leaf.shape[spec.split_dim], n), dim=spec.split_dim))
    if spec is not None:
        raise TypeError(f"{what}: {spec!r} is not a split spec (TensorChunkSpec(dim) or _Replicate)")
    if sizes is not None and isinstance(leaf, Tensor) and leaf.dim() >= 1 and leaf.shape[0] == sum(sizes):
        return list(torch.split(leaf, sizes))
    return [leaf] * n


def _split_flat(tensors: Sequence[Tensor], n: int, what: str, need_batch: bool) -> list[list]:
    """``_split_tree`` for a flat sequence of tensors with no spec, without pytree (every call's inputs
    and labels): per tensor its n chunks, each tensor repeated when none has a batch dimension."""
    first = next((t for t in tensors if t.dim() >= 1), None)
    if first is None:
        if need_batch:
            raise ValueError(f"{what} contains no tensor with a batch dimension; pass split_input to split it yourself")
        return [[t] * n for t in tensors]
    total = first.shape[0]
    check_microbatches(total, n, what)
    sizes = split_sizes(total, n)
    return [list(torch.split(t, sizes)) if t.dim() >= 1 and t.shape[0] == total else [t] * n for t in tensors]


def _split_tree(value: Any, spec_of: Callable[[pytree.TreeSpec], list], n: int, what: str, need_batch: bool) -> list:
    leaves, treespec = pytree.tree_flatten(value)
    specs = spec_of(treespec)
    sizes = _auto_sizes(leaves, specs, n, what)
    if sizes is None and need_batch and any(s is None for s in specs):
        raise ValueError(f"{what} contains no tensor with a batch dimension; pass split_input to split it yourself")
    columns = [_chunks(leaf, spec, sizes, n, what) for leaf, spec in zip(leaves, specs)]
    return [pytree.tree_unflatten([c[i] for c in columns], treespec) for i in range(n)]


def split_inputs(args: tuple, kwargs: dict, n: int, spec: Any = None) -> list[tuple[tuple, dict]]:
    """Per microbatch ``(args, kwargs)``. ``spec``: None, ``(args_spec, kwargs_spec)`` or
    ``f(args, kwargs, n) -> (args_list, kwargs_list)`` (the original library's contract)."""
    if spec is not None and is_function(spec):
        parts = spec(args, kwargs, n)
        if not (isinstance(parts, (tuple, list)) and len(parts) == 2 and len(parts[0]) == n and len(parts[1]) == n):
            raise ValueError(f"split_input must return (args_list, kwargs_list), each of num_microbatch={n} entries")
        return [(tuple(a), dict(k)) for a, k in zip(*parts)]
    if spec is not None and not (isinstance(spec, (tuple, list)) and len(spec) == 2):
        raise ValueError("RoundPipeRunConfig.split_input must be a function or (args_spec, kwargs_spec)")
    if spec is None and not kwargs and all(isinstance(a, Tensor) for a in args):
        columns = _split_flat(args, n, "the input", True)
        return [(tuple(c[i] for c in columns), {}) for i in range(n)]
    args_spec, kwargs_spec = spec if spec is not None else (None, None)

    def spec_of(treespec: pytree.TreeSpec) -> list:
        args_tree, kwargs_tree = treespec.children()
        return _spec_leaves(args_spec, args_tree, "split_input") + _spec_leaves(kwargs_spec, kwargs_tree, "split_input")

    return [(tuple(a), dict(k)) for a, k in _split_tree((tuple(args), dict(kwargs)), spec_of, n, "the input", True)]


def split_label(label: Any, n: int, spec: Any = None) -> list[Any]:
    """Per microbatch labels. ``spec``: None, a spec structure or ``f(label, n) -> list``."""
    if spec is not None and is_function(spec):
        parts = list(spec(label, n))
        if len(parts) != n:
            raise ValueError(f"split_label returned {len(parts)} microbatches, expected num_microbatch={n}")
        return parts
    if spec is None and isinstance(label, Tensor):
        return _split_flat([label], n, "the label", False)[0]
    return _split_tree(label, lambda treespec: _spec_leaves(spec, treespec, "split_label"), n, "the label", False)


# ------------------------------------------------------------------------------------------- merge
def _same(values: list) -> bool:
    first = values[0]
    if isinstance(first, Tensor):
        return all(isinstance(v, Tensor) and v.shape == first.shape and torch.equal(v, first) for v in values)
    try:
        return all(bool(v == first) for v in values)
    except Exception:  # values whose == is not a truth value
        return all(v is first for v in values)


def _merge_leaf(values: list, spec: Any) -> Any:
    chunk_spec, replicate, _ = _markers()
    first = values[0]
    if isinstance(spec, _Reduce):
        return functools.reduce(spec.reducer.reduce_fn, values, spec.reducer.init_value)
    if spec is replicate or isinstance(spec, replicate):
        return first
    if isinstance(spec, chunk_spec):
        return torch.cat(values, dim=spec.split_dim)
    if spec is not None:
        raise TypeError(f"merge_output: {spec!r} is not a merge spec (TensorChunkSpec(dim), _Replicate, _CustomReducer)")
    if isinstance(first, Tensor) and first.dim() >= 1:
        return torch.cat(values)
    if isinstance(first, Tensor) and first.is_floating_point() and len(values) > 1:
        return torch.stack(values).mean(0)
    if not _same(values):
        raise ValueError(f"merge_output: a {type(first).__name__} output differs between microbatches; pass merge_output to say how to merge it")
    return first


def merge_outputs(outputs: list[Any], spec: Any = None) -> Any:
    """Merge per-microbatch outputs (``spec``: None/True automatic, False packed, a spec structure
    or ``f(outputs) -> output``)."""
    if spec is not None and spec is not True and spec is not False and is_function(spec):
        return spec(outputs)
    flat = [pytree.tree_flatten(o) for o in outputs]
    leaves, treespec = flat[0]
    if any(s != treespec for _, s in flat):
        raise ValueError("merge_output: the microbatches' outputs differ in structure; pass merge_output to merge them")
    columns = [list(c) for c in zip(*(f for f, _ in flat))] if leaves else []
    if spec is False:
        return pytree.tree_unflatten([PackedData(c) for c in columns], treespec)
    specs = _spec_leaves(None if spec is True else spec, treespec, "merge_output")
    return pytree.tree_unflatten([_merge_leaf(c, s) for c, s in zip(columns, specs)], treespec)


def consecutive(slices: list[Tensor]) -> bool:
    """Whether ``slices`` are consecutive dimension-0 slices of one tensor (the automatic split's cut)."""
    first, offset = slices[0], slices[0].storage_offset()
    for t in slices:
        if (t.dim() == 0 or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != offset or t.shape[1:] != first.shape[1:] or t.stride() != first.stride()):
            return False
        offset += t.shape[0] * t.stride(0)
    return True


def _batch_of(slices: list[Tensor]) -> Tensor:
    """The tensor ``slices`` were cut from along dimension 0, as a view; a copy where they are not consecutive."""
    if not consecutive(slices):
        return torch.cat(slices)
    first = slices[0]
    return first.as_strided((sum(t.shape[0] for t in slices), *first.shape[1:]), first.stride(), first.storage_offset())


def join_cut(parts: list[Any]) -> Any:
    """Microbatches cut from one batch along dimension 0 as that batch: each tensor a view of the storage its
    slices share, not a copy (so a pinned batch stays pinned for its upload), or their concatenation where they
    are not consecutive slices; every other value must be the same in each microbatch (ValueError otherwise)."""
    flat = [pytree.tree_flatten(p) for p in parts]
    leaves, treespec = flat[0]
    if any(s != treespec for _, s in flat):
        raise ValueError("the microbatches differ in structure")
    joined = []
    for column in zip(*(f for f, _ in flat)):
        first = column[0]
        if isinstance(first, Tensor):
            joined.append(_batch_of(list(column)))
        elif _same(list(column)):
            joined.append(first)
        else:
            raise ValueError(f"a {type(first).__name__} value differs between the microbatches")
    return pytree.tree_unflatten(joined, treespec)


def summed_losses(losses: list, device: torch.device) -> Any:
    """The microbatches' losses summed: a tensor, or a list of sums when ``loss_fn`` returned several."""
    if isinstance(losses[0], torch.Tensor):
        return torch.stack([loss.to(device) for loss in losses]).sum()
    return [torch.stack([micro[i].to(device) for micro in losses]).sum() for i in range(len(losses[0]))]
