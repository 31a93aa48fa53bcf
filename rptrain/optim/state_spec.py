"""What an optimizer keeps per parameter, as data: torch's state name, its shape rule and dtype, so
memory can be counted before anything is allocated (the engine's fit check) and the flat-run step
can allocate it (flatstep.py)."""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence, Union

import torch

# "param": the parameter's shape; "scalar": a 0-d tensor (torch keeps one per parameter, the flat
# step shares one per run); "row"/"col": the parameter's shape with the last / second-to-last dim
# reduced to 1 (Adafactor's factored second moment).
Shape = Literal["param", "scalar", "row", "col"]


@dataclass(frozen=True)
class StateSpec:
    """One per-parameter state tensor of an optimizer."""

    name: str  # the key in ``optimizer.state[p]``, as torch names it
    shape: Shape
    dtype: Optional[torch.dtype] = None  # None: the parameter's dtype (scalars: float32, torch's scalar dtype)
    init: Union[float, str] = 0.0  # the starting value, or the name of the group option holding it

    def numel(self, shape: Sequence[int]) -> int:
        n = math.prod(shape)
        if self.shape == "scalar":
            return 1
        if self.shape == "row":
            return n // shape[-1]
        if self.shape == "col":
            return n // shape[-2]
        return n

    def bytes(self, shape: Sequence[int], param_dtype: torch.dtype) -> int:
        dtype = self.dtype or (torch.float32 if self.shape == "scalar" else param_dtype)
        return self.numel(shape) * dtype.itemsize

    def initial(self, group: dict) -> float:
        return float(group[self.init]) if isinstance(self.init, str) else self.init


def state_bytes(specs: Sequence[StateSpec], shape: Sequence[int], param_dtype: torch.dtype) -> int:
    """Bytes of optimizer state one parameter of ``shape`` holds under ``specs``."""
    return sum(spec.bytes(shape, param_dtype) for spec in specs)


def group_options(cls: type, kwargs: dict) -> dict:
    """The options a parameter group of optimizer ``cls`` gets from these constructor arguments
    (torch's defaults for the rest), known before any parameter exists."""
    torch_class = next(c for c in cls.__mro__ if c.__module__.startswith("torch.optim"))
    signature = inspect.signature(torch_class.__init__).parameters
    return {**{n: p.default for n, p in signature.items() if p.default is not inspect.Parameter.empty}, **kwargs}


def optimizer_memory(cls: type, master_dtype: torch.dtype, kwargs: dict) -> Any:
    """``cls``'s state per parameter element in the engine's optimizer description (rptrain/optim/state.py,
    issue 29's seam): each parameter-sized state one element of its dtype; 0-d states (step counts) are
    a few bytes per tensor and left out; Adafactor's factors count as one element, which is what a
    vector keeps and more than a matrix keeps (its row and column vectors)."""
    from .state import OptimizerMemory, StateTensor

    specs = cls.state_specs(group_options(cls, kwargs), torch.Size([1]))  # a vector's state: the most per element
    tensors = []
    for spec in specs:
        if spec.shape != "scalar":
            dtype = spec.dtype or master_dtype
            tensors.append(StateTensor(spec.name, dtype, dtype.itemsize))
    names = ", ".join(t.name for t in tensors) or "no state"
    return OptimizerMemory(tuple(tensors), f"{cls.__name__}: {names}")
