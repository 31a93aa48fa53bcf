"""Host-to-device copies that do not stall the caller."""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. CPU to GPU goes through pinned memory, so the copy is asynchronous: a
    copy from pageable memory makes the host wait for the GPU's queue."""
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
