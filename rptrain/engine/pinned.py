"""Pinned host tensors of exactly the size asked for.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds
every block up to a power of two (torch 2.11 on the H200 machine): Llama-3B's 12.8 GB fp32 master
takes 16 GiB of pinned, committed pages, and the engine's flat buffers together waste about 16 GiB
at 3B (fit.py's ``pinned_rounding``). Large buffers are instead mapped anonymously at their exact
size and registered with the driver (``cudaHostRegister``), the way CUDA documents for memory
allocated elsewhere; they are unregistered before the mapping goes away. Small buffers keep the
caching allocator: rounding them costs little and its cache saves registrations.

``pin="register"`` (``RoundPipe(..., pin_model="register")``, the original library's option)
registers every buffer that way, small ones too: no power-of-two rounding at all.
"""
from __future__ import annotations

import mmap
import weakref

import torch
from torch import Tensor

# Below this many bytes the caching allocator's rounding wastes at most this much, and registering
# pages costs more than it saves (cudaHostRegister pins page by page).
EXACT_FROM_BYTES = 64 << 20


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _registered(numel: int, dtype: torch.dtype) -> Tensor | None:
    """An anonymous mapping of exactly ``numel`` elements, page-locked; None where the driver refuses."""
    nbytes = numel * dtype.itemsize
    mapping = mmap.mmap(-1, nbytes)  # zero-filled, page-aligned, committed when pinned
    view = memoryview(mapping)
    t = torch.frombuffer(view, dtype=dtype, count=numel)  # the tensor keeps the memoryview alive
    if int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)) != 0:
        del t
        view.release()
        mapping.close()
        return None
    # The storage holds the memoryview, the memoryview the mapping. When the last tensor on the storage
    # goes, the memoryview dies: its finalizer unregisters the pages, then the mapping is unmapped.
    weakref.finalize(view, _unregister, t.data_ptr())
    return t


Pin = "bool | str"  # False, True (large buffers registered, small ones from the allocator) or "register" (all registered)


def _allocate(numel: int, dtype: torch.dtype, pin: Pin, fallback) -> Tensor:
    """A large (or with ``pin="register"`` any) pinned buffer as an exact registered mapping (already
    zero); else ``fallback``'s."""
    if numel and (pin == "register" or (pin and numel * dtype.itemsize >= EXACT_FROM_BYTES)):
        t = _registered(numel, dtype)
        if t is not None:
            return t
    return fallback(numel, dtype=dtype, pin_memory=bool(pin))


def empty(numel: int, dtype: torch.dtype, pin: Pin) -> Tensor:
    """A flat host tensor (uninitialised unless it is freshly mapped), pinned when ``pin``."""
    return _allocate(numel, dtype, pin, torch.empty)


def zeros(numel: int, dtype: torch.dtype, pin: Pin) -> Tensor:
    """A flat host tensor of zeros, pinned when ``pin`` (a fresh mapping is already zero)."""
    return _allocate(numel, dtype, pin, torch.zeros)


def rounding(nbytes: int) -> int:
    """Bytes the allocator adds to a pinned block of ``nbytes`` (fit.py's prediction)."""
    if nbytes >= EXACT_FROM_BYTES or nbytes <= 0:
        return 0
    return (1 << (nbytes - 1).bit_length()) - nbytes
