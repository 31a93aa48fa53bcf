"""RoundPipe's fit check on its own, for a model whose weights do not exist yet.

``RoundPipe(model, ...)`` decides whether the GPUs keep the model resident, whether the host keeps
compute copies, and where every run of the state lives (fit.py, placement.py), before it allocates
anything. That decision reads only shapes and dtypes, so it runs as well on a model built on the meta
device: ``check_model_fits`` lets a caller refuse a model that cannot fit before spending the time and
memory to build and initialise it (a 8 B model in fp32 is 32 GB and minutes on the CPU).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..optim.state import OptimizerMemory, state_memory_of
from .device import Device, make_devices
from .fit import DoesNotFit, Size, check_fit, host_keeps_compute_copies
from .gpushare import gpu_state_allowed
from .placement import Placement
from .planning import same_on_all_ranks
from .tuning import Tuning


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The engine's layers: a Sequential's children, any other module as one layer (as the original wraps it)."""
    return list(model) if isinstance(model, nn.Sequential) else [model]


def fits_resident(layers: list[nn.Module], devices: list[Device], tuning: Tuning, reducer: Any, gpu_state: bool) -> bool:
    """Small models stay on every GPU (uploaded once per version, not per stage); larger with GPU state."""
    cap = min(d.memory_cap() or 0 for d in devices)
    share = tuning.resident_share_gpu_state if gpu_state and len(devices) == 1 else tuning.resident_share
    # Two versions of the trainable weights (upload slot and live copy), one of the frozen.
    params = {id(p): p for layer in layers for p in layer.parameters()}.values()  # tied weights once
    weights = sum((2 if p.requires_grad else 1) * p.numel() * p.element_size() for p in params)
    return same_on_all_ranks(reducer, weights <= share * cap)


def placement_for(layers: list[nn.Module], optim_dtype: torch.dtype, devices: list[Device], tuning: Tuning, reducer: Any,
                  gpu_state: bool, max_host_memory: Size, max_gpu_memory: Size, optimizer: Optional[OptimizerMemory] = None,
                  single_version: Optional[bool] = None) -> tuple[bool, bool, Placement, bool]:
    """(resident, host compute copies, placement, single version) of an engine over ``layers``; raises
    DoesNotFit. ``single_version`` None: two versions (asynchronous steps) where they fit, else one."""
    resident = devices[0].is_cuda and fits_resident(layers, devices, tuning, reducer, gpu_state)
    copies = host_keeps_compute_copies(resident, tuning.refresh_gpu_share)

    def fit(single: bool) -> Placement:
        return check_fit(layers, optim_dtype, devices, resident, max_host_memory, max_gpu_memory, tuning.pin_frozen_share,
                         *gpu_state_allowed(gpu_state, devices, resident, tuning, single), compute_copies=copies,
                         optimizer=optimizer, single_version=single)

    if single_version is None:
        try:
            return resident, copies, fit(False), False
        except DoesNotFit:
            pass  # one version needs less: its refusal, if it comes, gives the smaller numbers
    single = single_version is not False
    return resident, copies, fit(single), single


def check_model_fits(model: nn.Module, optim_dtype: torch.dtype = torch.float32, devices: Any = None, *,
                     max_host_memory: Size = None, max_gpu_memory: Size = None, gpu_state: bool = True,
                     tuning: Optional[Tuning] = None, optimizer: Any = None, single_version: Optional[bool] = None) -> Placement:
    """The placement ``RoundPipe(model, optim_dtype, devices=devices, ...)`` would choose, or DoesNotFit,
    for ``model`` on any device, the meta device included (nothing is allocated). Under torchrun each
    rank decides alone here; the engine then agrees on residency across ranks."""
    memory = optimizer if isinstance(optimizer, OptimizerMemory) else state_memory_of(optimizer, optim_dtype)
    return placement_for(layers_of(model), optim_dtype, make_devices(devices), tuning or Tuning(), None, gpu_state,
                         max_host_memory, max_gpu_memory, memory, single_version)[2]
