"""Channels-last activations: convolutions on GPUs run their fastest (NHWC) kernels on them.

With ``RoundPipe(..., memory_format=torch.channels_last)`` every 4-D floating-point input of a
call is converted on the device, before the first layer, so the whole network's activations
follow (convolution, BatchNorm, ReLU and additions keep the layout). The 4-D weights are stored
channels-last too (layout.py), in the compute copy, the master, the gradients and the optimizer's
moments alike, as ``model.to(memory_format=torch.channels_last)`` stores them in plain PyTorch:
otherwise each convolution converts its weight on every call, forward and backward (plain PyTorch
with channels-last inputs only was 1.6 ms a step slower than fully channels-last on ResNet-34,
H200, 2026-12-03). Values do not depend on the layout: only which kernels run, hence the rounding,
changes.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from .batching import map_tensors

FORMATS = (torch.contiguous_format, torch.channels_last)


def check_memory_format(memory_format: Optional[torch.memory_format]) -> Optional[torch.memory_format]:
    if memory_format is not None and memory_format not in FORMATS:
        raise ValueError(f"memory_format must be None, torch.contiguous_format or torch.channels_last, got {memory_format!r}")
    return None if memory_format is torch.contiguous_format else memory_format


def convert_inputs(value: Any, memory_format: Optional[torch.memory_format]) -> Any:
    """``value`` with its 4-D floating-point tensors in ``memory_format`` (None: unchanged)."""
    if memory_format is None:
        return value

    def convert(t: Tensor) -> Tensor:
        return t.contiguous(memory_format=memory_format) if t.dim() == 4 and t.is_floating_point() else t

    return map_tensors(convert, value)


def has_convolutions(model: nn.Module) -> bool:
    """Whether channels-last can matter: the model holds a 2-D convolution."""
    return any(isinstance(m, nn.Conv2d) for m in model.modules())
