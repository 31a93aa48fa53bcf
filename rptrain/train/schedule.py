"""Learning-rate schedule: linear warmup, then constant or cosine decay, as a LambdaLR.

Step it on the optimizer thread (inside the engine's step function), never on the main thread.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR


def lr_factor(warmup_steps: int, decay: str, decay_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """f(step) = multiplier of the base lr for the optimizer step with index `step` (0-based)."""
    decay = getattr(decay, "value", decay)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if decay == "constant":
            return 1.0
        span = max(decay_steps - warmup_steps, 1)
        progress = min((step - warmup_steps) / span, 1.0)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_steps: int = 0,
    decay: str = "constant",
    decay_steps: Optional[int] = None,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """decay_steps=None decays over the whole run (total_steps)."""
    factor = lr_factor(warmup_steps, decay, decay_steps or total_steps, min_lr_ratio)
    return LambdaLR(optimizer, factor)
