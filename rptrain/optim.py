"""CPU optimizers for the master weights (create them inside ``OptimizerCtx``).

They are PyTorch's Adam and AdamW with the fused CPU kernel switched on by default: one
multi-threaded pass per tensor that also unscales fp16 gradients (see ``GradScaler.step``).
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["Adam", "AdamW"]


def _fused_default(params: Any, kwargs: dict) -> tuple[list, dict]:
    params = list(params)
    if "fused" not in kwargs and "foreach" not in kwargs and "differentiable" not in kwargs:
        tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
        kwargs["fused"] = all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors) or None
    return params, kwargs


class Adam(torch.optim.Adam):
    def __init__(self, params: Any, *args: Any, **kwargs: Any):
        params, kwargs = _fused_default(params, kwargs)
        super().__init__(params, *args, **kwargs)


class AdamW(torch.optim.AdamW):
    def __init__(self, params: Any, *args: Any, **kwargs: Any):
        params, kwargs = _fused_default(params, kwargs)
        super().__init__(params, *args, **kwargs)
