"""The flat-run step for any optimizer whose update is elementwise.

The engine keeps master weights and gradients in flat buffers; ``_FlatRuns`` (flat.py) finds the
runs of parameters that lie back to back there. Each optimizer declares its per-parameter state
(``STATE``, state_spec.py); here every state tensor of a run lives in one flat buffer, viewed per
parameter in ``optimizer.state`` under torch's names, and its 0-d states (step, ...) are one tensor
shared by the run's parameters, so ``state_dict``/``load_state_dict``, schedulers and GradScaler see
torch's optimizer. The subclass steps a whole run at once in ``_step_run``. Anything the flat path
does not cover (complex parameters, ``differentiable``, ``capturable``, parameters not laid out in
runs, state that differs within a run) takes torch's own step.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional

import torch
from torch import Tensor

from . import front
from .flat import _FlatRuns, _Views, _flat, _like, _span, _state_unchanged, before_torch_step, on_cpu_or_cuda
from .kernels import Elementwise
from .state_spec import StateSpec, optimizer_memory


def fused_by_default(params: Any, kwargs: dict, devices: tuple[str, ...] = ("cpu", "cuda")) -> tuple[list, dict]:
    """``fused=True`` unless the caller chose an implementation or some parameter cannot take it
    (not floating point, or on a device without torch's fused kernel)."""
    params = list(params)
    if "fused" not in kwargs and "foreach" not in kwargs and "differentiable" not in kwargs:
        tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
        tensors = [p[1] if isinstance(p, tuple) else p for p in tensors]  # named parameters
        kwargs["fused"] = all(t.is_floating_point() and t.device.type in devices for t in tensors) or None
    return params, kwargs


class _RunState:
    """One run's flat state buffers (by torch's state name) and the per-parameter views of them."""

    def __init__(self, flat: dict[str, Tensor], views: _Views, fresh: bool):
        self.flat, self.views, self.fresh = flat, views, fresh


class FlatStepMixin:
    """Put before the torch optimizer class: ``class RMSprop(FlatStepMixin, torch.optim.RMSprop)``."""

    STATE: ClassVar[tuple[StateSpec, ...]] = ()
    _kernel: ClassVar[Optional[Elementwise]] = None  # the one-pass update, where no fused kernel exists
    # 0-d states live where torch keeps them: on the host, except for fused kernels (on the parameter's device).
    _SCALARS_ON_PARAM_DEVICE: ClassVar[bool] = False

    @classmethod
    def state_specs(cls, group: dict, shape: torch.Size) -> tuple[StateSpec, ...]:
        """The states one parameter of ``shape`` in ``group`` gets (some depend on options)."""
        return cls.STATE

    @classmethod
    def state_memory(cls, master_dtype: torch.dtype, **kwargs: Any) -> Any:
        """The engine's optimizer description (rptrain/optim/state.py) of this optimizer with these arguments."""
        return optimizer_memory(cls, master_dtype, kwargs)

    def _flat_supported(self, group: dict) -> bool:
        """Options of ``group`` the flat step handles (the subclass narrows it)."""
        return not group.get("differentiable") and not group.get("capturable")

    def _step_run(self, group: dict, param: Tensor, grad: Tensor, state: _RunState, grad_scale: Optional[Tensor]) -> None:
        raise NotImplementedError

    def _flat_eligible(self) -> bool:
        return all(
            self._flat_supported(group) and on_cpu_or_cuda(group["params"]) and all(map(Tensor.is_floating_point, group["params"]))
            for group in self.param_groups
        )

    def _torch_step(self, closure: Optional[Callable]) -> Any:
        before_torch_step(self)  # type: ignore[arg-type]
        return super().step(closure)  # type: ignore[misc]

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None) -> Any:
        if not self._flat_eligible():
            return self._torch_step(closure)
        if "_flat_runs" not in self.__dict__:
            self._flat_runs = _FlatRuns(self)
            self._run_states: dict[tuple, _RunState] = {}
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf):
            return None  # GradScaler found inf/NaN: skip, as torch's fused steps do
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for group in self.param_groups:
            runs = self._flat_runs.runs(group)
            if not runs and any(p.grad is not None for p in group["params"]):
                return self._torch_step(None)  # some group cannot be flattened: torch's path for all
            for run in runs:
                state = self._run_state(group, run)
                if state is None:
                    return self._torch_step(None)
                work.append((group, run, state))
        # GPU runs first: their kernels are queued in microseconds and run while the host grinds its runs.
        work.sort(key=lambda item: item[1][0].device.type != "cuda")
        grad_scale = getattr(self, "grad_scale", None)
        scales: dict[torch.device, Optional[Tensor]] = {}
        for group, run, state in work:
            numel, device = _span(run), run[0].device
            if device not in scales:
                scales[device] = None if grad_scale is None else grad_scale.to(device)
            param = _flat(run[0], numel)
            self._step_run(group, param, _flat(run[0].grad, numel), state, scales[device])
            state.fresh = False
            front.report(param)  # a call overlapping this step may read the run now (front.py)
        return loss

    def _run_state(self, group: dict, run: list[Tensor]) -> Optional[_RunState]:
        """The run's flat state, made on first use from whatever ``optimizer.state`` holds (torch's
        eager initial state, a loaded state dict, an earlier arrangement). None where the run's
        parameters disagree (some without state, different step counts): torch steps those."""
        specs = self.state_specs(group, run[0].shape)
        key = tuple(map(id, run))
        state = self.state  # type: ignore[attr-defined]
        cached = self._run_states.get(key)
        if cached is not None and _state_unchanged(state, cached.views):
            return cached
        present = [all(state[p].get(spec.name) is not None for spec in specs) for p in run]
        if any(present) and not all(present):
            return None
        loaded = all(present) and bool(specs)
        numel, device = _span(run), run[0].device
        flat: dict[str, Tensor] = {}
        views: list[dict[str, Tensor]] = [{} for _ in run]
        for spec in specs:
            if spec.shape == "scalar":
                where = device if self._SCALARS_ON_PARAM_DEVICE else torch.device("cpu")
                if loaded:
                    values = [torch.as_tensor(state[p][spec.name]).detach() for p in run]
                    if any(not torch.equal(v.cpu(), values[0].cpu()) for v in values[1:]):
                        return None
                    shared = values[0].to(where, spec.dtype or torch.float32, copy=True)
                else:
                    shared = torch.tensor(spec.initial(group), dtype=spec.dtype or torch.float32, device=where)
                flat[spec.name] = shared
                for view in views:
                    view[spec.name] = shared
            elif spec.shape == "param":
                buffer = torch.full((numel,), spec.initial(group), dtype=spec.dtype or run[0].dtype, device=device)
                flat[spec.name] = buffer
                for p, view in zip(run, views):
                    view[spec.name] = _like(buffer, p.storage_offset() - run[0].storage_offset(), p)
                    if loaded:
                        view[spec.name].copy_(state[p][spec.name])
            else:
                raise ValueError(f"{type(self).__name__}: state {spec.name!r} of shape {spec.shape!r} cannot be flat")
        for p, view in zip(run, views):
            state[p].update(view)
        made = _RunState(flat, _Views(run, views), fresh=not loaded)
        if len(self._run_states) > 64:  # arrangements come and go (users may set .grad themselves)
            self._run_states.clear()
        self._run_states[key] = made
        return made
