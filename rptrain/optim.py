"""CPU optimizers for the master weights (create them inside ``OptimizerCtx``).

They are PyTorch's Adam and AdamW, run with PyTorch's fused CPU kernel (``Adam`` is the name
the original library's ``roundpipe.optim`` exports; any other torch optimizer works on the master
weights too, at torch's own speed). torch.optim calls that
kernel once per parameter tensor: for a ResNet's hundred-odd small tensors most calls are too
small to spread over the cores. The engine keeps master weights and gradients in flat buffers, so
here the kernel runs once per contiguous run of parameters instead: the moments live in flat
buffers too, viewed per parameter in ``optimizer.state`` so state dicts look exactly like
torch's. Parameters on a GPU (the engine's GPU share) get the same treatment there, stepped first.
Anything the flat path does not cover (amsgrad, maximize, non-contiguous parameters, ...) takes
torch's own step.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .engine.layout import ALIGN_BYTES

__all__ = ["Adam", "AdamW"]


def _fused_default(params: Any, kwargs: dict) -> tuple[list, dict]:
    params = list(params)
    if "fused" not in kwargs and "foreach" not in kwargs and "differentiable" not in kwargs:
        tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
        kwargs["fused"] = all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors) or None
    return params, kwargs


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


def _gap(prev: Tensor, t: Tensor) -> int:
    """Elements of padding between the end of ``prev`` and ``t`` in one storage, or -1 if ``t`` does
    not come next. Only alignment padding counts (``t`` on the first 256-byte boundary after
    ``prev``, the engine's layout): no other tensor can sit in such a gap."""
    if t.dtype != prev.dtype or not _dense(t) or t.untyped_storage().data_ptr() != prev.untyped_storage().data_ptr():
        return -1
    end = prev.storage_offset() + prev.numel()
    step = max(1, ALIGN_BYTES // t.element_size())
    if t.storage_offset() == end or t.storage_offset() == -(-end // step) * step:
        return t.storage_offset() - end
    return -1


def _follows(prev: Tensor, t: Tensor) -> bool:
    """``t`` continues ``prev``'s run, gradients laid out alike. Padding inside a run holds zero
    weights and zero gradients, so Adam leaves it at zero."""
    gap = _gap(prev, t)
    return gap >= 0 and _gap(prev.grad, t.grad) == gap and _same_order(t, t.grad)


class _FlatRuns:
    """Finds runs of parameters whose data and gradients are both dense, in one order, and keeps their
    moments in flat buffers."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.cache: dict[tuple, tuple[Tensor, Tensor, Tensor, list[Tensor], list[Tensor]]] = {}
        self._layouts: dict[tuple, list[list[int]]] = {}

    def runs(self, group: dict) -> list[list[Tensor]]:
        """The group's runs, as lists of parameters. Where every tensor sits decides them, so they
        are found once per arrangement (the engine's two gradient buffers make two)."""
        params = group["params"]
        where = tuple(
            (p.data_ptr(),) if p.grad is None
            else (p.data_ptr(), p.grad.data_ptr(), p.grad.untyped_storage().data_ptr(), p.grad.stride())
            for p in params
        )
        key = (id(params), where)
        found = self._layouts.get(key)
        if found is None:
            index = {id(p): i for i, p in enumerate(params)}
            found = [[index[id(p)] for p in run] for run in self._find_runs(params)]
            if len(self._layouts) > 16:  # arrangements come and go (users may set .grad themselves)
                self._layouts.clear()
            self._layouts[key] = found
        return [[params[i] for i in run] for run in found]

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

    def state(self, run: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """Flat exp_avg, exp_avg_sq and the shared step count of ``run``, viewed in optimizer.state."""
        key = tuple(id(p) for p in run)
        state = self.optimizer.state
        cached = self.cache.get(key)
        if cached is not None:
            m, v, step, m_views, v_views = cached
            if all(state[p].get("exp_avg") is mv and state[p].get("exp_avg_sq") is vv and state[p].get("step") is step
                   for p, mv, vv in zip(run, m_views, v_views)):
                return m, v, step
        numel, device = _span(run), run[0].device  # a GPU share's moments live on its GPU (engine/gpushare.py)
        m = torch.zeros(numel, dtype=run[0].dtype, device=device)
        v = torch.zeros(numel, dtype=run[0].dtype, device=device)
        steps = [state[p]["step"] for p in run if "step" in state[p]]
        step = torch.tensor(float(steps[0]) if steps else 0.0, dtype=torch.float32, device=device)
        m_views, v_views = [], []
        for p in run:
            offset = p.storage_offset() - run[0].storage_offset()
            mv, vv = _like(m, offset, p), _like(v, offset, p)
            if "exp_avg" in state[p]:  # e.g. after load_state_dict: keep the loaded moments
                mv.copy_(state[p]["exp_avg"])
                vv.copy_(state[p]["exp_avg_sq"])
            state[p].update(exp_avg=mv, exp_avg_sq=vv, step=step)
            m_views.append(mv)
            v_views.append(vv)
        self.cache[key] = (m, v, step, m_views, v_views)
        return m, v, step


def _match_grad_layouts(groups: list[dict]) -> None:
    """torch's fused CPU kernels walk parameter, gradient and moments as flat memory, so a gradient
    strided unlike its parameter (a transposed view, say) gives wrong updates (torch 2.14): copy
    such gradients into the parameter's layout first."""
    for group in groups:
        for p in group["params"]:
            g = p.grad
            if g is not None and p.device.type == "cpu" and g.stride() != p.stride():
                p.grad = torch.empty_strided(p.shape, p.stride(), dtype=g.dtype).copy_(g)


class _FlatStepMixin:
    _kernel: Callable

    def _flat_eligible(self) -> bool:
        d = self.defaults
        if not d.get("fused") or d.get("amsgrad") or d.get("maximize") or d.get("capturable") or d.get("differentiable"):
            return False
        return all(p.device.type in ("cpu", "cuda") for g in self.param_groups for p in g["params"])

    def _torch_step(self, closure: Optional[Callable]) -> Any:
        if self.defaults.get("fused"):
            _match_grad_layouts(self.param_groups)
        return super().step(closure)  # type: ignore[misc]

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None) -> Any:
        if not self._flat_eligible():
            return self._torch_step(closure)
        if not hasattr(self, "_flat_runs"):
            self._flat_runs = _FlatRuns(self)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf):
            return None  # GradScaler found inf/NaN: skip, as torch's fused step does
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        all_runs = [self._flat_runs.runs(group) for group in self.param_groups]
        for group, runs in zip(self.param_groups, all_runs):
            if not runs and any(p.grad is not None for p in group["params"]):
                return self._torch_step(None)  # some group cannot be flattened: torch's path for all
        # GPU runs first: their kernels are queued in microseconds and run while the CPU grinds through
        # the host runs (the engine's GPU share holds the first layers; torch's own grouping by device
        # follows a hash map's order).
        work = [(group, run) for group, runs in zip(self.param_groups, all_runs) for run in runs]
        work.sort(key=lambda item: item[1][0].device.type != "cuda")
        scales: dict[torch.device, Optional[Tensor]] = {}
        for group, run in work:
            beta1, beta2 = group["betas"]
            # torch.optim.Adam(decoupled_weight_decay=True) is AdamW (the original library documents it).
            kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay") else self._kernel
            m, v, step = self._flat_runs.state(run)
            step += 1
            numel, device = m.numel(), m.device
            if device not in scales:
                scales[device] = None if grad_scale is None else grad_scale.to(device)
            kernel(
                [_flat(run[0], numel)], [_flat(run[0].grad, numel)], [m], [v], [], [step],
                lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                amsgrad=False, maximize=False, grad_scale=scales[device], found_inf=None,
            )
        return loss


class Adam(_FlatStepMixin, torch.optim.Adam):
    _kernel = staticmethod(torch._fused_adam_)

    def __init__(self, params: Any, *args: Any, **kwargs: Any):
        params, kwargs = _fused_default(params, kwargs)
        super().__init__(params, *args, **kwargs)


class AdamW(_FlatStepMixin, torch.optim.AdamW):
    _kernel = staticmethod(torch._fused_adamw_)

    def __init__(self, params: Any, *args: Any, **kwargs: Any):
        params, kwargs = _fused_default(params, kwargs)
        super().__init__(params, *args, **kwargs)
