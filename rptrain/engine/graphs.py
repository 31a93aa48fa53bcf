"""CUDA graphs for a stage's forward and backward, so small layers stop paying Python launch costs.

A graph replays the exact kernels it recorded, reading and writing the same addresses. That holds
for a fused stage whose weights stay resident on the GPU (a static "live" copy), whose buffers sit
in static tensors, and whose input has the same shapes as when it was recorded. The loss function
runs eagerly between the two graphs. ``torch.cuda.make_graphed_callables`` records them; its
warm-up iterations would update BatchNorm statistics and consume random numbers, so both are put
back. A stage that cannot be recorded (a CPU sync inside a layer, say) runs eagerly from then on.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree


class _FlatStage(nn.Module):
    """The stage's layers as a function of flat tensors (what graph capture needs)."""

    def __init__(self, modules: list[nn.Module], spec: pytree.TreeSpec, constants: list, call: Callable):
        super().__init__()
        self.layers = nn.ModuleList(modules)
        self._spec, self._constants, self._call = spec, constants, call
        self.out_spec: Optional[pytree.TreeSpec] = None
        self.out_constants: list = []

    def forward(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        x = _rebuild(self._spec, self._constants, tensors)
        for layer in self.layers:
            x = self._call(layer, x)
        leaves, self.out_spec = pytree.tree_flatten(x)
        self.out_constants = [None if isinstance(v, Tensor) else v for v in leaves]
        return tuple(v for v in leaves if isinstance(v, Tensor))


def _rebuild(spec: pytree.TreeSpec, constants: list, tensors: Any) -> Any:
    it = iter(tensors)
    return pytree.tree_unflatten([next(it) if c is None else c for c in constants], spec)


def signature(value: Any) -> Optional[tuple]:
    """A hashable description of the input's structure, shapes and constants (None: not graphable)."""
    leaves, spec = pytree.tree_flatten(value)
    parts = []
    for v in leaves:
        if isinstance(v, Tensor):
            parts.append(("t", tuple(v.shape), v.dtype, v.requires_grad, v.device))
        else:
            try:
                hash(v)
            except TypeError:
                return None
            parts.append(("c", v))
    return (spec, tuple(parts))


class StageGraphs:
    """Recorded stages on one device, by (layers, training modes, input signature)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._graphs: dict[tuple, Optional[_FlatStage]] = {}
        self._pool = None

    def run(self, key: tuple, modules: list[nn.Module], x: Any, call: Callable) -> Any:
        """``x`` through the stage: replayed when recorded, recorded on first sight, else eager."""
        if key not in self._graphs:
            self._graphs[key] = self._record(modules, x, call)
        stage = self._graphs[key]
        if stage is None:
            for layer in modules:
                x = call(layer, x)
            return x
        leaves, _ = pytree.tree_flatten(x)
        outputs = stage(*[v for v in leaves if isinstance(v, Tensor)])
        return _rebuild(stage.out_spec, stage.out_constants, outputs)

    def _record(self, modules: list[nn.Module], x: Any, call: Callable) -> Optional[_FlatStage]:
        leaves, spec = pytree.tree_flatten(x)
        constants = [None if isinstance(v, Tensor) else v for v in leaves]
        sample = tuple(v.detach().clone().requires_grad_(v.requires_grad) for v in leaves if isinstance(v, Tensor))
        stage = _FlatStage(modules, spec, constants, call)
        buffers = [b for m in modules for b in m.buffers()]
        saved = [b.detach().clone() for b in buffers]
        rng = torch.cuda.get_rng_state(self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            stage = torch.cuda.make_graphed_callables(stage, sample, pool=self._pool, allow_unused_input=True)
        except Exception as e:  # anything a graph cannot hold: keep the stage eager
            warnings.warn(f"rptrain: running layers {type(modules[0]).__name__}.. eagerly, CUDA graph capture failed: {e}", stacklevel=3)
            stage = None
        finally:
            with torch.no_grad():  # the warm-up iterations updated statistics and used random numbers
                for b, value in zip(buffers, saved):
                    b.copy_(value)
            torch.cuda.set_rng_state(rng, self.device)
        return stage
