"""RoundPipe's fit check on its own, for a model whose weights do not exist yet.

``RoundPipe(model, ...)`` decides whether the GPUs keep the model resident, whether the host keeps
compute copies, and where every run of the state lives (fit.py, placement.py), before it allocates
anything. That decision reads only shapes and dtypes, so it runs as well on a model built on the meta
device: ``check_model_fits`` lets a caller refuse a model that cannot fit before spending the time and
memory to build and initialise it (a 8 B model in fp32 is 32 GB and minutes on the CPU).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch
from torch import nn

from ..optim.state import OptimizerMemory, state_memory_of
from .device import Device, make_devices
from .fit import DoesNotFit, Size, check_fit, host_keeps_compute_copies
from .gpushare import gpu_state_allowed
from .placement import HOST, Placement
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
    DoesNotFit. ``single_version`` None: two versions (asynchronous steps) unless one version keeps so much
    more of the state on the GPU that its synchronous step wins (Tuning.one_version_host_share), or two do
    not fit. One version considers the weights streamed as well as resident: without a second version a
    streamed GPU share's master is its compute copy, so streaming frees the resident copies' GPU memory."""
    resident = devices[0].is_cuda and fits_resident(layers, devices, tuning, reducer, gpu_state)

    def fit(single: bool, resident: bool) -> tuple[bool, bool, Placement, bool]:
        copies = host_keeps_compute_copies(resident, tuning.refresh_gpu_share)
        return resident, copies, check_fit(layers, optim_dtype, devices, resident, max_host_memory, max_gpu_memory, tuning.pin_frozen_share,
                                           *gpu_state_allowed(gpu_state, devices, resident, tuning, single), compute_copies=copies,
                                           optimizer=optimizer, single_version=single), single

    def one_version() -> tuple[bool, bool, Placement, bool]:
        """Resident or streamed, whichever steps fewer parameters on the host (resident on a tie)."""
        choices, refusal = [], None
        for streamed in ((False, True) if resident else (False,)):
            try:
                choices.append(fit(True, resident and not streamed))
            except DoesNotFit as e:
                refusal = refusal or e
        if not choices:
            raise refusal
        best = min(range(len(choices)), key=lambda i: choices[i][2].params_on(HOST))  # the first on a tie
        return choices[same_on_all_ranks(reducer, best)]

    if single_version is not None:
        return one_version() if single_version else fit(False, resident)
    try:
        two = fit(False, resident)
    except DoesNotFit:
        return one_version()  # one version needs less: its refusal, if it comes, gives the smaller numbers
    host_two = two[2].params_on(HOST)
    if not host_two or not (gpu_state and devices[0].is_cuda and len(devices) == 1):
        return two
    try:
        one = one_version()
    except DoesNotFit:
        return two
    host_one = one[2].params_on(HOST)
    if not same_on_all_ranks(reducer, host_one < tuning.one_version_host_share * host_two):
        return two
    why = (f"one version of the weights: its host steps {host_one / 1e9:.2f} B parameters, two versions' {host_two / 1e9:.2f} B "
           f"(Tuning.one_version_host_share {tuning.one_version_host_share})")
    return one[0], one[1], replace(one[2], notes=one[2].notes + (why,)), True


def check_model_fits(model: nn.Module, optim_dtype: torch.dtype = torch.float32, devices: Any = None, *,
                     max_host_memory: Size = None, max_gpu_memory: Size = None, gpu_state: bool = True,
                     tuning: Optional[Tuning] = None, optimizer: Any = None, single_version: Optional[bool] = None) -> Placement:
    """The placement ``RoundPipe(model, optim_dtype, devices=devices, ...)`` would choose, or DoesNotFit,
    for ``model`` on any device, the meta device included (nothing is allocated). Under torchrun each
    rank decides alone here; the engine then agrees on residency across ranks."""
    memory = optimizer if isinstance(optimizer, OptimizerMemory) else state_memory_of(optimizer, optim_dtype)
    return placement_for(layers_of(model), optim_dtype, make_devices(devices), tuning or Tuning(), None, gpu_state,
                         max_host_memory, max_gpu_memory, memory, single_version)[2]
