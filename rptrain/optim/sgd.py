"""SGD (torch's fused CPU/CUDA kernel once per flat run) and ASGD (a compiled elementwise update)."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .flatstep import FlatStepMixin, _RunState, fused_by_default
from .kernels import elementwise, signed_decayed
from .state_spec import StateSpec


class SGD(FlatStepMixin, torch.optim.SGD):
    _SCALARS_ON_PARAM_DEVICE = True

    def __init__(self, params: Any, *args: Any, **kwargs: Any):
        params, kwargs = fused_by_default(params, kwargs)
        super().__init__(params, *args, **kwargs)

    @classmethod
    def state_specs(cls, group: dict, shape: torch.Size) -> tuple[StateSpec, ...]:
        return (StateSpec("momentum_buffer", "param"),) if group["momentum"] != 0 else ()

    def _flat_supported(self, group: dict) -> bool:
        return bool(group.get("fused")) and super()._flat_supported(group)

    def _step_run(self, group: dict, param: Tensor, grad: Tensor, state: _RunState, grad_scale: Optional[Tensor]) -> None:
        lr = group["lr"]
        torch._fused_sgd_(
            [param], [grad], [state.flat["momentum_buffer"]] if group["momentum"] != 0 else [],
            weight_decay=float(group["weight_decay"]), momentum=float(group["momentum"]),
            lr=lr.to(param.device) if isinstance(lr, Tensor) else float(lr), dampening=float(group["dampening"]),
            nesterov=group["nesterov"], maximize=group["maximize"],
            is_first_step=state.fresh,  # torch starts the momentum buffer at the gradient, undampened
            grad_scale=grad_scale, found_inf=None,
        )


def _asgd_update(param: Tensor, grad: Tensor, ax: Tensor, h: Tensor, averaging: bool) -> None:
    grad = signed_decayed(grad, param, h[0], h[1])
    shrink, eta, mu = h[2], h[3], h[4]
    param.mul_(shrink)
    param.sub_(eta * grad)
    if averaging:  # a flag, not a where: until t0 the average is a copy and need not be read
        ax.add_((param - ax) * mu)
    else:
        ax.copy_(param)


class ASGD(FlatStepMixin, torch.optim.ASGD):
    STATE = (
        StateSpec("step", "scalar"), StateSpec("eta", "scalar", init="lr"), StateSpec("mu", "scalar", init=1.0),
        StateSpec("ax", "param"),
    )
    _kernel = elementwise(_asgd_update)

    def _step_run(self, group: dict, param: Tensor, grad: Tensor, state: _RunState, grad_scale: Optional[Tensor]) -> None:
        step, eta, mu = state.flat["step"], state.flat["eta"], state.flat["mu"]
        lr, lambd, alpha, t0 = float(group["lr"]), group["lambd"], group["alpha"], group["t0"]
        step += 1
        eta_value, mu_value = eta.item(), mu.item()
        self._kernel(
            [param, grad, state.flat["ax"]],
            [-1.0 if group["maximize"] else 1.0, group["weight_decay"], 1 - lambd * eta_value, eta_value, mu_value],
            averaging=mu_value != 1,
        )
        step_value = step.item()
        eta.copy_(torch.as_tensor(lr / ((1 + lambd * lr * step_value) ** alpha)))
        mu.copy_(torch.as_tensor(1 / max(1, step_value - t0)))
