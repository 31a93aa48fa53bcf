"""engine.channels_last: whether the engine runs convolution models' activations channels-last.

null (auto) turns it on for models with a 2-D convolution whose engine computes on CUDA. That
default rests on the measurement in issue 22 (H200, ResNet-34 at batch 128, plain PyTorch with
AMP fp16: 15.0-15.3 ms a step channels-last against 16.5-18.2 ms without); on the CPU the
standard layout is kept, as NHWC kernels there are no faster for these small images.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from rptrain.engine.memory_format import has_convolutions


def choose_memory_format(choice: Optional[bool], model: nn.Module, devices: Any) -> Optional[torch.memory_format]:
    """RoundPipe's memory_format for engine.channels_last = ``choice`` (None: auto)."""
    if choice is None:
        choice = has_convolutions(model) and _on_cuda(devices)
    return torch.channels_last if choice else None


def _on_cuda(devices: Any) -> bool:
    """Whether RoundPipe(devices=devices) computes on GPUs (None: every GPU there is)."""
    if devices is None:
        return torch.cuda.is_available()
    return any(torch.device(d).type == "cuda" for d in devices)
