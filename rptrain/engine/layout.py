"""Where each parameter (or buffer) of the model lives inside a few flat tensors, one per dtype.

Tensors are numbered in layer order, so the tensors of a run of layers occupy one contiguous range
of each flat tensor and a stage moves with one copy per dtype. Each tensor starts on a 256-byte
boundary, like a fresh allocation: CPU and GPU kernels pick their code path (and so their rounding)
by alignment, and this keeps results bitwise equal to plain PyTorch. The few padding elements
between tensors stay zero. A tensor shared by several layers
(tied weights) gets one slot, owned by the first layer that has it; later layers refer back to it,
which adds a second range to their stages.

A 4-D tensor may be stored channels-last (``channels_last=True``): its elements lie in NHWC order
and its views are the channels-last tensors ``Tensor.to(memory_format=torch.channels_last)`` gives,
so convolutions find their weights, and write their weight gradients, in the layout of their
fastest GPU kernels without a conversion per call (measured in bench/README, issue 22). Everything
elementwise (casts, the optimizer) is indifferent to the order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Slot:
    index: int
    key: str  # which flat tensor: the dtype's name
    offset: int
    numel: int
    shape: torch.Size
    requires_grad: bool
    owner: int  # first layer holding this tensor
    channels_last: bool = False  # stored in NHWC order (4-D tensors only)


def shaped(flat: Tensor, slot: Slot) -> Tensor:
    """``slot.numel`` elements of ``flat`` as the slot's tensor, in the order they are stored."""
    if not slot.channels_last:
        return flat.view(slot.shape)
    n, c, h, w = slot.shape
    return flat.view(n, h, w, c).permute(0, 3, 1, 2)


@dataclass(frozen=True)
class Range:
    key: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


ALIGN_BYTES = 256


def _dtype_key(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def align_step(dtype: torch.dtype) -> int:
    """Elements between the boundaries a ``dtype`` flat tensor's slots start on."""
    return max(1, ALIGN_BYTES // dtype.itemsize)


def _align(offset: int, dtype: torch.dtype) -> int:
    step = align_step(dtype)
    return -(-offset // step) * step


# A master parameter's attribute: the boundaries (in elements) its layout starts slots on. The master
# is wider than the compute copy whose offsets it shares (an fp32 master at a bf16 copy's 128-element
# boundaries: 512 bytes), so rptrain.optim's runs (optim/flat.py) read the layout's step from here.
ALIGN_ATTR = "_rptrain_align_step"


class FlatLayout:
    def __init__(self, named_tensors_per_layer: Sequence[Iterable[tuple[str, Tensor]]], channels_last: bool = False):
        self.slots: list[Slot] = []
        self.layer_slots: list[list[tuple[str, int]]] = []
        self.dtypes: dict[str, torch.dtype] = {}
        self.sizes: dict[str, int] = {}
        seen: dict[int, int] = {}
        for layer, named in enumerate(named_tensors_per_layer):
            entries = []
            for name, tensor in named:
                if id(tensor) not in seen:
                    key = _dtype_key(tensor.dtype)
                    self.dtypes[key] = tensor.dtype
                    offset = _align(self.sizes.get(key, 0), tensor.dtype)
                    nhwc = channels_last and tensor.dim() == 4
                    slot = Slot(len(self.slots), key, offset, tensor.numel(), tensor.shape, tensor.requires_grad, layer, nhwc)
                    self.sizes[key] = offset + tensor.numel()
                    seen[id(tensor)] = slot.index
                    self.slots.append(slot)
                entries.append((name, seen[id(tensor)]))
            self.layer_slots.append(entries)
        # Offsets of each flat tensor inside one concatenation of all of them (the master copy's layout).
        self.base: dict[str, int] = {}
        total = 0
        for key, size in self.sizes.items():
            self.base[key] = total
            total += _align(size, torch.float32)  # keeps every dtype's region aligned in the master copy
        self.total = total
        self._range_cache: dict[tuple[int, int], list[Range]] = {}
        self._slots_cache: dict[Range, list[Slot]] = {}
        self._runs_cache: dict[Range, list[tuple[int, int]]] = {}

    @classmethod
    def of_parameters(cls, layers: Sequence[nn.Module], trainable: bool = True, channels_last: bool = False) -> "FlatLayout":
        """The parameters that require grad (``trainable``) or the frozen ones."""
        named = [[(n, p) for n, p in m.named_parameters(remove_duplicate=False) if p.requires_grad == trainable] for m in layers]
        return cls(named, channels_last)

    @classmethod
    def of_buffers(cls, layers: Sequence[nn.Module]) -> "FlatLayout":
        return cls([list(m.named_buffers(remove_duplicate=False)) for m in layers])

    def slots_of(self, start: int, stop: int) -> list[Slot]:
        indices = sorted({i for layer in range(start, stop) for _, i in self.layer_slots[layer]})
        return [self.slots[i] for i in indices]

    def ranges(self, start: int, stop: int) -> list[Range]:
        """Contiguous ranges covering every tensor of layers [start, stop)."""
        cached = self._range_cache.get((start, stop))
        if cached is not None:
            return cached
        slots = sorted(self.slots_of(start, stop), key=lambda s: (s.key, s.offset))
        merged: list[Range] = []
        for s in slots:
            if s.numel == 0:
                continue
            if merged and merged[-1].key == s.key and self.adjacent(merged[-1].stop, s):
                merged[-1] = Range(s.key, merged[-1].start, s.offset + s.numel)
            else:
                merged.append(Range(s.key, s.offset, s.offset + s.numel))
        self._range_cache[(start, stop)] = merged
        return merged

    def adjacent(self, stop: int, slot: Slot) -> bool:
        """Whether ``slot`` follows position ``stop`` with only padding in between."""
        return slot.offset in (stop, _align(stop, self.dtypes[slot.key]))

    def runs_in_range(self, r: Range) -> list[tuple[int, int]]:
        """[start, stop) runs of adjacent slots inside range ``r`` (cached: every gradient download
        of a call walked its slots; 0.44 ms a step at ResNet-34 on the CPU, bench/host_step.py)."""
        found = self._runs_cache.get(r)
        if found is None:
            found = self._runs_cache[r] = [(a, b) for a, b, _ in self.runs(self.slots_in_range(r), [None] * len(self.slots))]
        return found

    def runs(self, slots: Sequence[Slot], tags: Sequence) -> list[tuple[int, int, object]]:
        """[start, stop, tag) runs of ``slots`` (by offset): adjacent slots with equal ``tags[slot.index]`` merge."""
        found: list[tuple[int, int, object]] = []
        for slot in slots:
            tag = tags[slot.index]
            if found and found[-1][2] == tag and self.adjacent(found[-1][1], slot):
                found[-1] = (found[-1][0], slot.offset + slot.numel, tag)
            else:
                found.append((slot.offset, slot.offset + slot.numel, tag))
        return found

    def slots_in_range(self, r: Range) -> list[Slot]:
        """Slots inside range ``r``, by offset (cached: called for every gradient download)."""
        found = self._slots_cache.get(r)
        if found is None:
            found = sorted(
                (s for s in self.slots if s.key == r.key and r.start <= s.offset < r.stop and s.numel > 0),
                key=lambda s: s.offset,
            )
            self._slots_cache[r] = found
        return found

    def nbytes(self, start: int, stop: int) -> int:
        return sum(r.numel * self.dtypes[r.key].itemsize for r in self.ranges(start, stop))

    def allocate(self, pin_memory: bool = False) -> dict[str, Tensor]:
        return {
            key: torch.zeros(size, dtype=self.dtypes[key], pin_memory=pin_memory) for key, size in self.sizes.items()
        }

    def view(self, flats: dict[str, Tensor], slot: Slot, base: int = 0) -> Tensor:
        """``slot`` as a tensor of its shape inside ``flats[slot.key]``, which starts at element ``base``."""
        start = slot.offset - base
        return shaped(flats[slot.key][start : start + slot.numel], slot)

    def master_view(self, master: Tensor, slot: Slot) -> Tensor:
        start = self.base[slot.key] + slot.offset
        return shaped(master[start : start + slot.numel], slot)

    def master_range(self, master: Tensor, r: Range) -> Tensor:
        return master[self.base[r.key] + r.start : self.base[r.key] + r.stop]
