"""Adam and AdamW: torch's fused CPU (and CUDA) kernels called once per flat run of the master weights."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .flat import _FlatRuns, _flat, _match_grad_layouts


def _fused_default(params: Any, kwargs: dict) -> tuple[list, dict]:
    params = list(params)
    if "fused" not in kwargs and "foreach" not in kwargs and "differentiable" not in kwargs:
        tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
        kwargs["fused"] = all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors) or None
    return params, kwargs


class _FlatStepMixin:
    _kernel: Callable

    def _flat_eligible(self) -> bool:
        d = self.defaults
        if not d.get("fused") or d.get("amsgrad") or d.get("maximize") or d.get("capturable") or d.get("differentiable"):
            return False
        return all(p.device.type in ("cpu", "cuda") for g in self.param_groups for p in g["params"])

    def _torch_step(self, closure: Optional[Callable]) -> Any:
        from .flatstep import unshare_scalars  # (imported here: one line to merge with issue 29's adam.py)

        unshare_scalars(self)  # type: ignore[arg-type]
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
