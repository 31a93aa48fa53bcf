"""A device's random-number state, read and written under one lock.

torch's Generator.get_state and set_state hold the GIL while they wait for the generator's mutex, and
get_state may let the GIL go while it holds that mutex (a garbage collection running Python code as it
wraps the new tensor). Two device threads of the CPU engine (one shared generator) then waited for each
other for good (tests/test_engine_equivalence.py::test_several_devices_match_one in the full suite,
2026-12-06). Waiting for this lock instead lets the GIL go, so only one thread at a time is inside them.
"""
from __future__ import annotations

import threading

import torch
from torch import Tensor

_LOCK = threading.Lock()


def get_state(device: torch.device) -> Tensor:
    with _LOCK:
        return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_state(state: Tensor, device: torch.device) -> None:
    with _LOCK:
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
