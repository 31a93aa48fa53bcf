"""Adam's relatives: Adamax, NAdam and RAdam, as compiled elementwise updates over flat runs
(kernels.py). Each follows torch's for-loop implementation op for op; the scalars it derives from the
step count (bias corrections, NAdam's momentum schedule, RAdam's rectification) are computed on the
host, in double, as torch does."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from .flatstep import FlatStepMixin, _RunState
from .kernels import elementwise
from .state_spec import StateSpec


def _adamax_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_inf: Tensor, h: Any, maximize: bool, decay: bool) -> None:
    clr, beta1, beta2, eps, weight_decay = h[0], h[1], h[2], h[3], h[4]
    if maximize:
        grad = -grad
    if decay:
        grad = grad + weight_decay * param
    exp_avg.lerp_(grad, 1 - beta1)
    exp_inf.copy_(torch.maximum(exp_inf * beta2, grad.abs() + eps))
    param.sub_(clr * exp_avg / exp_inf)


class Adamax(FlatStepMixin, torch.optim.Adamax):
    STATE = (StateSpec("step", "scalar"), StateSpec("exp_avg", "param"), StateSpec("exp_inf", "param"))
    _kernel = elementwise(_adamax_update)

    def _step_run(self, group: dict, param: Tensor, grad: Tensor, state: _RunState, grad_scale: Optional[Tensor]) -> None:
        step = state.flat["step"].add_(1).item()
        beta1, beta2 = group["betas"]
        self._kernel(
            [param, grad, state.flat["exp_avg"], state.flat["exp_inf"]],
            [float(group["lr"]) / (1 - beta1**step), beta1, beta2, group["eps"], group["weight_decay"]],
            maximize=group["maximize"], decay=group["weight_decay"] != 0,
        )


def _nadam_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, h: Any,
                  maximize: bool, decay: bool, decoupled: bool) -> None:
    beta1, beta2, eps, weight_decay, shrink, bias_correction2, grad_coef, avg_coef = h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]
    if maximize:
        grad = -grad
    if decay and decoupled:
        param.mul_(shrink)
    elif decay:
        grad = grad + weight_decay * param
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).add_((1 - beta2) * grad * grad)
    denom = (exp_avg_sq / bias_correction2).sqrt() + eps
    param.add_(grad_coef * grad / denom)
    param.add_(avg_coef * exp_avg / denom)


class NAdam(FlatStepMixin, torch.optim.NAdam):
    STATE = (StateSpec("step", "scalar"), StateSpec("mu_product", "scalar", init=1.0),
             StateSpec("exp_avg", "param"), StateSpec("exp_avg_sq", "param"))
    _kernel = elementwise(_nadam_update)

    def _step_run(self, group: dict, param: Tensor, grad: Tensor, state: _RunState, grad_scale: Optional[Tensor]) -> None:
        step = state.flat["step"].add_(1).item()
        mu_product = state.flat["mu_product"]
        lr, (beta1, beta2), decay = float(group["lr"]), group["betas"], group["momentum_decay"]
        mu = beta1 * (1.0 - 0.5 * (0.96 ** (step * decay)))
        mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * decay)))
        mu_product *= mu  # a float32 tensor, as torch keeps it
        product = mu_product.item()
        self._kernel(
            [param, grad, state.flat["exp_avg"], state.flat["exp_avg_sq"]],
            [beta1, beta2, group["eps"], group["weight_decay"], 1 - lr * group["weight_decay"], 1 - beta2**step,
             -lr * (1.0 - mu) / (1.0 - product), -lr * mu_next / (1.0 - product * mu_next)],
            maximize=group["maximize"], decay=group["weight_decay"] != 0, decoupled=group["decoupled_weight_decay"],
        )


def _radam_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, h: Any,
                  maximize: bool, decay: bool, decoupled: bool, rectified: bool) -> None:
    beta1, beta2, eps, weight_decay, shrink, bias_correction1, lr, sqrt_bias_correction2, rect = (
        h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8])
    if maximize:
        grad = -grad
    if decay and decoupled:
        param.mul_(shrink)
    elif decay:
        grad = grad + weight_decay * param
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).add_((1 - beta2) * grad * grad)
    corrected = exp_avg / bias_correction1
    if rectified:
        param.sub_(corrected * lr * (sqrt_bias_correction2 / (exp_avg_sq.sqrt() + eps)) * rect)
    else:
        param.sub_(corrected * lr)


class RAdam(FlatStepMixin, torch.optim.RAdam):
    STATE = (StateSpec("step", "scalar"), StateSpec("exp_avg", "param"), StateSpec("exp_avg_sq", "param"))
    _kernel = elementwise(_radam_update)

    def _step_run(self, group: dict, param: Tensor, grad: Tensor, state: _RunState, grad_scale: Optional[Tensor]) -> None:
        step = state.flat["step"].add_(1).item()
        lr, (beta1, beta2) = float(group["lr"]), group["betas"]
        bias_correction2 = 1 - beta2**step
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step * (beta2**step) / bias_correction2
        rectified = rho_t > 5.0
        rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) if rectified else 1.0
        self._kernel(
            [param, grad, state.flat["exp_avg"], state.flat["exp_avg_sq"]],
            [beta1, beta2, group["eps"], group["weight_decay"], 1 - lr * group["weight_decay"], 1 - beta1**step, lr,
             bias_correction2**0.5, rect],
            maximize=group["maximize"], decay=group["weight_decay"] != 0,
            decoupled=group["decoupled_weight_decay"], rectified=rectified,
        )
