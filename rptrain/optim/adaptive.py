"""Per-element step sizes: Adagrad (torch's fused kernel once per flat run), Adadelta, RMSprop and
Rprop (compiled elementwise updates, kernels.py). Each update follows torch's for-loop implementation
op for op; the scalars it derives from the step count are computed on the host, in double, as torch does."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .flatstep import FlatStepMixin, _RunState, fused_by_default
from .kernels import elementwise, signed_decayed
from .state_spec import StateSpec


class Adagrad(FlatStepMixin, torch.optim.Adagrad):
    # torch makes this state in the constructor (the sum starts at initial_accumulator_value).
    STATE = (StateSpec("step", "scalar"), StateSpec("sum", "param", init="initial_accumulator_value"))
    _SCALARS_ON_PARAM_DEVICE = True  # the fused kernel counts steps where the parameter is

    def __init__(self, params: Any, *args: Any, **kwargs: Any):
        params, kwargs = fused_by_default(params, kwargs, devices=("cpu",))  # torch fuses Adagrad on the host only
        super().__init__(params, *args, **kwargs)

    def _flat_supported(self, group: dict) -> bool:
        return bool(group.get("fused")) and super()._flat_supported(group)

    def _step_run(self, group: dict, param: Tensor, grad: Tensor, state: _RunState, grad_scale: Optional[Tensor]) -> None:
        lr = group["lr"]
        state.flat["step"].add_(1)  # torch counts the step before its fused kernel runs
        torch._fused_adagrad_(
            [param], [grad], [state.flat["sum"]], [state.flat["step"]],
            lr=lr.to(param.device) if isinstance(lr, Tensor) else float(lr), lr_decay=group["lr_decay"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
            grad_scale=grad_scale, found_inf=None,
        )


def _adadelta_update(param: Tensor, grad: Tensor, square_avg: Tensor, acc_delta: Tensor, h: Tensor) -> None:
    grad = signed_decayed(grad, param, h[0], h[1])
    lr, rho, one_minus_rho, eps = h[2], h[3], h[4], h[5]  # 1 - rho from the host, in double, as torch
    square_avg.mul_(rho).add_(one_minus_rho * grad * grad)
    delta = (acc_delta + eps).sqrt() / (square_avg + eps).sqrt() * grad
    acc_delta.mul_(rho).add_(one_minus_rho * delta * delta)
    param.sub_(lr * delta)


class Adadelta(FlatStepMixin, torch.optim.Adadelta):
    STATE = (StateSpec("step", "scalar"), StateSpec("square_avg", "param"), StateSpec("acc_delta", "param"))
    _kernel = elementwise(_adadelta_update)

    def _step_run(self, group: dict, param: Tensor, grad: Tensor, state: _RunState, grad_scale: Optional[Tensor]) -> None:
        state.flat["step"].add_(1)
        self._kernel(
            [param, grad, state.flat["square_avg"], state.flat["acc_delta"]],
            [-1.0 if group["maximize"] else 1.0, group["weight_decay"], float(group["lr"]), group["rho"], 1 - group["rho"],
             group["eps"]],
        )


def _rmsprop_update(param: Tensor, grad: Tensor, square_avg: Tensor, grad_avg: Tensor, momentum_buffer: Tensor,
                    h: Tensor, centered: bool, momentum: bool) -> None:
    grad = signed_decayed(grad, param, h[0], h[1])
    lr, alpha, one_minus_alpha, eps, momentum_factor = h[2], h[3], h[4], h[5], h[6]
    square_avg.mul_(alpha).add_(one_minus_alpha * grad * grad)
    if centered:
        grad_avg.lerp_(grad, one_minus_alpha)
        avg = (square_avg - grad_avg * grad_avg).sqrt() + eps
    else:
        avg = square_avg.sqrt() + eps
    if momentum:
        momentum_buffer.mul_(momentum_factor).add_(grad / avg)
        param.sub_(lr * momentum_buffer)
    else:
        param.sub_(lr * grad / avg)


class RMSprop(FlatStepMixin, torch.optim.RMSprop):
    _kernel = elementwise(_rmsprop_update)

    @classmethod
    def state_specs(cls, group: dict, shape: torch.Size) -> tuple[StateSpec, ...]:
        return (
            StateSpec("step", "scalar"), StateSpec("square_avg", "param"),
            *((StateSpec("momentum_buffer", "param"),) if group["momentum"] > 0 else ()),
            *((StateSpec("grad_avg", "param"),) if group["centered"] else ()),
        )

    def _step_run(self, group: dict, param: Tensor, grad: Tensor, state: _RunState, grad_scale: Optional[Tensor]) -> None:
        state.flat["step"].add_(1)
        square_avg = state.flat["square_avg"]
        momentum, centered = group["momentum"] > 0, group["centered"]
        self._kernel(
            [param, grad, square_avg, state.flat["grad_avg"] if centered else square_avg,
             state.flat["momentum_buffer"] if momentum else square_avg],  # unused slots: any tensor
            [-1.0 if group["maximize"] else 1.0, group["weight_decay"], float(group["lr"]), group["alpha"], 1 - group["alpha"],
             group["eps"], group["momentum"]],
            centered=centered, momentum=momentum,
        )


def _rprop_update(param: Tensor, grad: Tensor, prev: Tensor, step_size: Tensor, h: Tensor) -> None:
    grad = grad * h[0]
    etaminus, etaplus, step_size_min, step_size_max = h[1], h[2], h[3], h[4]
    sign = (grad * prev).sign()
    step_size.mul_(torch.where(sign > 0, etaplus, torch.where(sign < 0, etaminus, 1.0))).clamp_(step_size_min, step_size_max)
    grad = torch.where(sign < 0, 0.0, grad)  # after a sign change, no step and no memory of this gradient
    param.sub_(grad.sign() * step_size)
    prev.copy_(grad)


class Rprop(FlatStepMixin, torch.optim.Rprop):
    STATE = (StateSpec("step", "scalar"), StateSpec("prev", "param"), StateSpec("step_size", "param", init="lr"))
    _kernel = elementwise(_rprop_update)

    def _step_run(self, group: dict, param: Tensor, grad: Tensor, state: _RunState, grad_scale: Optional[Tensor]) -> None:
        state.flat["step"].add_(1)
        etaminus, etaplus = group["etas"]
        step_size_min, step_size_max = group["step_sizes"]
        self._kernel(
            [param, grad, state.flat["prev"], state.flat["step_size"]],
            [-1.0 if group["maximize"] else 1.0, etaminus, etaplus, step_size_min, step_size_max],
        )
