"""What an optimizer keeps per parameter, as data: torch's state name, its shape rule and dtype, so
memory can be counted before anything is allocated (the engine's fit check) and the flat-run step
can allocate it (flatstep.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, Sequence, Union

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
