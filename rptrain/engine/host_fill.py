"""Filling the host's flat tensors from the model, one layer at a time.

Each layer's tensors are copied into the flats (the master, or the GPU share's master on the GPU; the
host compute copy; frozen weights; buffers) and replaced at once by views of them, or by placeholders
where the host keeps no copy: a layer's own memory goes as soon as it is copied. With ``materialise``
(a model built on the meta device) each layer is made real just before its copy, wherever the caller
initialises it (on a GPU machine, the GPU): host memory then peaks at the flats plus one layer, and no
whole host copy of the model exists at any time.

Tensors are looked up by (layer, name) after the layer is made real: making a meta layer real creates
new Parameter objects, so the ones the layout saw are gone by then.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from .layout import FlatLayout

if TYPE_CHECKING:
    from .host import HostState


def owners(layout: FlatLayout) -> list[tuple[int, str]]:
    """(layer, name) of each slot's first occurrence: where its tensor is read (a tied weight once)."""
    found: dict[int, tuple[int, str]] = {}
    for layer, entries in enumerate(layout.layer_slots):
        for name, index in entries:
            found.setdefault(index, (layer, name))
    return [found[i] for i in range(len(layout.slots))]


class _Frozen:
    """The frozen flats, written slot by slot in order: alignment padding is zeroed as it is passed
    (the flats come from ``torch.empty``, which commits pages only when they are written)."""

    def __init__(self, layout: FlatLayout, flats: dict[str, Tensor]):
        self.layout, self.flats, self.ends = layout, flats, dict.fromkeys(flats, 0)

    def store(self, index: int, t: Tensor) -> Tensor:
        slot = self.layout.slots[index]
        self.flats[slot.key][self.ends[slot.key] : slot.offset].zero_()
        view = self.layout.view(self.flats, slot)
        view.copy_(t.detach())
        self.ends[slot.key] = slot.offset + slot.numel
        return view

    def finish(self) -> None:
        for key, flat in self.flats.items():
            flat[self.ends[key] :].zero_()


def fill(host: "HostState", layers: Sequence[nn.Module], materialise: Optional[Callable[[int], None]]) -> list[Tensor]:
    """Copy every layer into ``host``'s flats, layer by layer (materialising each first when given);
    returns the trainable parameters in their layout's slot order."""
    kinds = {"params": owners(host.params), "frozen": owners(host.frozen_layout), "buffers": owners(host.buffer_layout)}
    by_layer: dict[int, list[tuple[str, int, str]]] = {}
    for kind, places in kinds.items():
        for index, (layer, name) in enumerate(places):
            by_layer.setdefault(layer, []).append((kind, index, name))
    frozen = _Frozen(host.frozen_layout, host.frozen)
    home = torch.device("cpu") if materialise is not None else None  # the user's module lives on the host
    trainable: list[Optional[Tensor]] = [None] * len(kinds["params"])
    with torch.no_grad():
        for i, layer in enumerate(layers):
            if materialise is not None:
                materialise(i)
            for kind, index, name in by_layer.get(i, ()):
                t = layer.get_buffer(name) if kind == "buffers" else layer.get_parameter(name)
                if kind == "params":
                    _store_trainable(host, index, t, home)
                    trainable[index] = t
                elif kind == "frozen":
                    t.data = frozen.store(index, t)
                else:
                    slot = host.buffer_layout.slots[index]
                    view = host.buffer_layout.view(host.buffers, slot)
                    view.copy_(t.detach())
                    t.data = view
    frozen.finish()
    return trainable  # type: ignore[return-value]  (every slot's owner is visited)


def _store_trainable(host: "HostState", index: int, p: Tensor, home: Optional[torch.device]) -> None:
    """The master (and the host compute copy) := ``p``; then ``p`` shows the compute copy, or keeps
    weights of its own on the host (keep_user_weights), or becomes a placeholder that commits no memory."""
    slot = host.params.slots[index]
    host.master_params[index].copy_(p.detach())
    if host.compute is not None and not host.on_gpu(slot):
        view = host.host.view(host.compute[0], slot)
        view.copy_(p.detach())
        p.data = view
    elif host.keeps_user_weights:
        if home is not None and p.device != home:
            p.data = p.detach().to(home)
    else:  # a placeholder of its shape: a whole model in the compute dtype (16 GB at 8 B) that a caller reading
        # the weights through state_dict() never needs; torch.empty commits no pages, and nothing writes it
        p.data = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=home or p.device)
