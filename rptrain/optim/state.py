"""What an optimizer keeps per parameter: its state tensors and their bytes, known before it exists.

The engine checks that the training state fits (engine/fit.py) and places it (engine/placement.py)
before the optimizer is built, since the optimizer is made from the engine's master parameters. So an
optimizer class says what it will keep: a classmethod ``state_memory(master_dtype, **kwargs)``
returning an ``OptimizerMemory`` (its constructor's keyword arguments, e.g. ``state_dtype``, decide
it). ``state_memory_of`` looks the method up on a class or an import path (the CLI's ``_target_``);
an optimizer without one gets a conservative default, said in the placement printout.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch


@dataclass(frozen=True)
class StateTensor:
    """One state tensor per parameter: its name in ``optimizer.state``, the dtype it is stored in and
    the bytes it takes per parameter element (per-block scales included)."""

    name: str
    dtype: torch.dtype
    bytes_per_element: float


@dataclass(frozen=True)
class OptimizerMemory:
    """An optimizer's state per parameter; ``what`` says which optimizer and how (printed with the placement)."""

    tensors: tuple[StateTensor, ...]
    what: str

    @property
    def bytes_per_param(self) -> float:
        return sum(t.bytes_per_element for t in self.tensors)


def moments(names: tuple[str, ...], dtype: torch.dtype, what: str) -> OptimizerMemory:
    """``names`` state tensors, each one element of ``dtype`` per parameter element."""
    return OptimizerMemory(tuple(StateTensor(n, dtype, dtype.itemsize) for n in names), what)


def assumed(name: str, master_dtype: torch.dtype) -> OptimizerMemory:
    """The default for optimizers that do not say: Adam's two moments, in the master's dtype or fp32 if wider
    (the most state torch's optimizers keep, amsgrad and Adafactor's factors aside)."""
    dtype = master_dtype if master_dtype.itemsize >= 4 else torch.float32
    return moments(("exp_avg", "exp_avg_sq"), dtype, f"{name}: state unknown, assumed two {_short(dtype)} tensors per parameter (Adam's)")


def state_memory_of(optimizer: Union[type, str, None], master_dtype: torch.dtype, **kwargs: Any) -> OptimizerMemory:
    """``optimizer``'s state per parameter, with these constructor arguments. ``optimizer``: a class, its
    import path, or None (the engine's default: rptrain.optim.Adam)."""
    if optimizer is None:
        from .adam import Adam
        optimizer = Adam
    cls = _resolve(optimizer) if isinstance(optimizer, str) else optimizer
    describe = getattr(cls, "state_memory", None) if cls is not None else None
    if describe is None:
        return assumed(getattr(cls, "__name__", str(optimizer)), master_dtype)
    return describe(master_dtype, **kwargs)


def _resolve(path: str) -> Optional[type]:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
            torch.int8: "int8", torch.uint8: "uint8"}.get(dtype, str(dtype))
