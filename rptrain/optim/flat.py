"""Flat runs: parameters whose data and gradients are dense and adjacent in one storage (the engine's
flat per-dtype layout), so an optimizer kernel runs once per run instead of once per tensor."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..engine import pinned
from ..engine.layout import ALIGN_ATTR, ALIGN_BYTES
from . import assist


def _span(run: list[Tensor]) -> int:
    return run[-1].storage_offset() + run[-1].numel() - run[0].storage_offset()


def _flat(first: Tensor, numel: int) -> Tensor:
    """``numel`` elements of ``first``'s storage starting at ``first``."""
    return torch.as_strided(first.detach(), (numel,), (1,), first.storage_offset())


def _dense(t: Tensor) -> bool:
    """Whether ``t`` fills its span of storage without gaps: standard or channels-last order
    (the engine stores convolution weights channels-last when its memory_format asks for it)."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def _same_order(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` lay out their elements in one order (strides of size-1 dims do not matter)."""
    return all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def _like(flat: Tensor, offset: int, p: Tensor) -> Tensor:
    """``p.numel()`` elements of ``flat`` from ``offset``, viewed with ``p``'s shape and order."""
    return flat.as_strided(p.shape, p.stride(), offset)


def _gap(prev: Tensor, t: Tensor, step: int) -> int:
    """Elements of padding between the end of ``prev`` and ``t`` in one storage, or -1 if ``t`` does
    not come next. Only alignment padding counts (``t`` on the first boundary of ``step`` elements
    after ``prev``, as the engine lays tensors out): no other tensor can sit in such a gap."""
    if t.dtype != prev.dtype or not _dense(t) or t.untyped_storage().data_ptr() != prev.untyped_storage().data_ptr():
        return -1
    end = prev.storage_offset() + prev.numel()
    if t.storage_offset() == end or t.storage_offset() == -(-end // step) * step:
        return t.storage_offset() - end
    return -1


def _follows(prev: Tensor, t: Tensor) -> bool:
    """``t`` continues ``prev``'s run, gradients laid out alike. Padding inside a run holds zero
    weights and zero gradients, so Adam leaves it at zero. The boundaries are 256 bytes in the
    parameters' dtype, or what the engine's layout says it used (layout.ALIGN_ATTR)."""
    step = getattr(t, ALIGN_ATTR, 0) or max(1, ALIGN_BYTES // t.element_size())
    gap = _gap(prev, t, step)
    return gap >= 0 and _gap(prev.grad, t.grad, step) == gap and _same_order(t, t.grad)


def _where(params: list[Tensor]) -> tuple:
    """Where ``params`` and their gradients sit: their addresses, and the gradients' identities (a
    gradient tensor keeps its strides and storage; ``runs`` holds it, so its id is not reused). Read
    every step, so it is C-level maps (ResNet-34's 117 parameters: 0.19 ms a step as a per-tensor
    tuple on this 2-core machine, 0.03 ms so)."""
    grads = [p.grad for p in params]
    if any(g is None for g in grads):
        return tuple((p.data_ptr(),) if p.grad is None else (p.data_ptr(), id(p.grad), p.grad.data_ptr()) for p in params)
    return tuple(map(Tensor.data_ptr, params)), tuple(map(id, grads)), tuple(map(Tensor.data_ptr, grads))


def _zeros(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A run's flat state: pinned on the host while a GPU assists the host's step (assist.py), so its chunks
    travel by DMA at full speed."""
    helper = assist.current()
    if device.type == "cpu" and helper is not None and helper.device.type == "cuda":
        return pinned.zeros(numel, dtype, True)
    return torch.zeros(numel, dtype=dtype, device=device)


def on_cpu_or_cuda(params: list[Tensor]) -> bool:
    """Whether every tensor is on a CPU or a CUDA device (read every step: C-level maps, no device objects)."""
    return all(map(operator.or_, map(_IS_CPU, params), map(_IS_CUDA, params)))


_IS_CPU, _IS_CUDA = operator.attrgetter("is_cpu"), operator.attrgetter("is_cuda")


class _Views:
    """A run's state as ``state`` made it: each state name's tensor for every parameter of the run, to
    check with C-level maps that nobody has replaced one (a loaded state dict, a user's own tensor)."""

    def __init__(self, run: list[Tensor], views: list[dict[str, Tensor]], step: Optional[Tensor] = None):
        self.run = list(run)
        self.by_name = {name: [v[name] for v in views] for name in views[0]} if views else {}
        if step is not None:  # one count shared by the run
            self.by_name["step"] = [step] * len(self.run)


def _state_unchanged(state: dict, made: _Views) -> bool:
    dicts = list(map(state.get, made.run))
    if None in dicts:
        return False
    return all(all(map(operator.is_, map(operator.methodcaller("get", name), dicts), values)) for name, values in made.by_name.items())


class _FlatRuns:
    """Finds runs of parameters whose data and gradients are both dense, in one order, and keeps their
    moments in flat buffers."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.cache: dict[tuple, tuple[dict[str, Tensor], Tensor, _Views]] = {}
        self._layouts: dict[tuple, tuple[list[list[int]], list]] = {}

    def runs(self, group: dict) -> list[list[Tensor]]:
        """The group's runs, as lists of parameters. Where every tensor sits decides them, so they
        are found once per arrangement (the engine's two gradient buffers make two)."""
        params = group["params"]
        key = (id(params), _where(params))
        found = self._layouts.get(key)
        if found is None:
            index = {id(p): i for i, p in enumerate(params)}
            found = [[index[id(p)] for p in run] for run in self._find_runs(params)]
            if len(self._layouts) > 16:  # arrangements come and go (users may set .grad themselves)
                self._layouts.clear()
            # The gradients are kept with the runs: their ids are in the key, so no later tensor may reuse one.
            self._layouts[key] = (found, [p.grad for p in params])
            return [[params[i] for i in run] for run in found]
        return [[params[i] for i in run] for run in found[0]]

    @staticmethod
    def _find_runs(params: list[Tensor]) -> list[list[Tensor]]:
        runs: list[list[Tensor]] = []
        for p in params:
            if p.grad is None:
                continue
            if runs and _follows(runs[-1][-1], p):
                runs[-1].append(p)
            elif _dense(p) and _dense(p.grad) and _same_order(p, p.grad):
                runs.append([p])
            else:
                return []  # let torch handle the unusual case
        return runs

    def state(self, run: list[Tensor], layout: tuple["FlatState", ...]) -> tuple[dict[str, Tensor], Tensor]:
        """The run's state tensors (flat, by name, as ``layout`` describes them) and its shared step
        count, viewed per parameter in optimizer.state (exactly torch's state dict for full-size tensors)."""
        key = tuple(map(id, run))
        state = self.optimizer.state
        cached = self.cache.get(key)
        if cached is not None and _state_unchanged(state, cached[2]):
            return cached[0], cached[1]
        numel, device = _span(run), run[0].device  # a GPU share's state lives on its GPU (engine/gpushare.py)
        flats = {s.name: _zeros(s.numel(numel), s.dtype or run[0].dtype, device) for s in layout}
        steps = [state[p]["step"] for p in run if "step" in state[p]]
        step = torch.tensor(float(steps[0]) if steps else 0.0, dtype=torch.float32, device=device)
        views = []
        for p in run:
            offset = p.storage_offset() - run[0].storage_offset()
            per_param = {s.name: s.view(flats[s.name], offset, p) for s in layout}
            if all(name in state[p] for name in per_param):  # e.g. after load_state_dict: keep the loaded state
                for name, view in per_param.items():
                    view.copy_(state[p][name])
            state[p].update(per_param, step=step)
            views.append(per_param)
        self.cache[key] = (flats, step, _Views(run, views, step))
        return flats, step


@dataclass(frozen=True)
class FlatState:
    """One state tensor of a run: ``dtype`` (None: the parameters'); ``block`` > 0: one element per
    ``block`` elements of the run (a scale per block), else one per element, padded to ``pad`` elements."""

    name: str
    dtype: Optional[torch.dtype] = None
    block: int = 0
    pad: int = 1

    def numel(self, span: int) -> int:
        return -(-span // self.block) if self.block else -(-span // self.pad) * self.pad

    def view(self, flat: Tensor, offset: int, p: Tensor) -> Tensor:
        """Parameter ``p``'s part (it starts ``offset`` elements into the run): shaped like ``p``, or its
        blocks' scales (a block shared with a neighbour appears in both)."""
        if not self.block:
            return _like(flat, offset, p)
        return flat[offset // self.block : -(-(offset + p.numel()) // self.block)]


def _match_grad_layouts(groups: list[dict]) -> None:
    """torch's fused CPU kernels walk parameter, gradient and moments as flat memory, so a gradient
    strided unlike its parameter (a transposed view, say) gives wrong updates (torch 2.14): copy
    such gradients into the parameter's layout first."""
    for group in groups:
        for p in group["params"]:
            g = p.grad
            if g is not None and p.device.type == "cpu" and g.stride() != p.stride():
                p.grad = torch.empty_strided(p.shape, p.stride(), dtype=g.dtype).copy_(g)


def unshare_scalars(optimizer: torch.optim.Optimizer) -> None:
    """Call before torch's own step. torch counts each parameter's steps in place, so a count the flat
    path shares across a run would advance once per parameter: each parameter gets its own copy."""
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for name, value in state.items():
                if isinstance(value, Tensor) and value.dim() == 0:
                    if id(value) in seen:
                        state[name] = value.clone()
                    seen.add(id(value))


def before_torch_step(optimizer: torch.optim.Optimizer) -> None:
    """What every flat-run optimizer does before falling back to torch's own step: per-parameter step
    counts, and gradients in their parameters' layout for torch's fused kernels."""
    unshare_scalars(optimizer)
    if optimizer.defaults.get("fused"):
        _match_grad_layouts(optimizer.param_groups)
