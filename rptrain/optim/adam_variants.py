"""Adam's relatives: Adamax, NAdam and RAdam, as compiled elementwise updates over flat runs
(kernels.py). Each follows torch's for-loop implementation op for op; the scalars it derives from the
step count (bias corrections, NAdam's momentum schedule, RAdam's rectification) are computed on the
host, in double, as torch does."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .flatstep import FlatStepMixin, _RunState
from .kernels import elementwise, signed_decayed
from .state_spec import StateSpec


def _adamax_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_inf: Tensor, h: Tensor) -> None:
    grad = signed_decayed(grad, param, h[0], h[1])
    clr, one_minus_beta1, beta2, eps = h[2], h[3], h[4], h[5]
    exp_avg.lerp_(grad, one_minus_beta1)
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
            [-1.0 if group["maximize"] else 1.0, group["weight_decay"], float(group["lr"]) / (1 - beta1**step), 1 - beta1,
             beta2, group["eps"]],
        )


def _nadam_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, h: Tensor) -> None:
    shrink, one_minus_beta1, beta2, one_minus_beta2, eps = h[2], h[3], h[4], h[5], h[6]
    bias_correction2, grad_coef, avg_coef = h[7], h[8], h[9]
    param.mul_(shrink)  # decoupled weight decay (1 without)
    grad = signed_decayed(grad, param, h[0], h[1])
    exp_avg.lerp_(grad, one_minus_beta1)
    exp_avg_sq.mul_(beta2).add_(one_minus_beta2 * grad * grad)
    denom = (exp_avg_sq / bias_correction2).sqrt() + eps
    param.add_(grad_coef * grad / denom)
    param.add_(avg_coef * exp_avg / denom)


def _decay_scalars(group: dict, lr: float) -> tuple[float, float, float]:
    """sign (-1 to maximize), weight decay added to the gradient, factor shrinking the weights first."""
    decay, decoupled = group["weight_decay"], group["decoupled_weight_decay"]
    return -1.0 if group["maximize"] else 1.0, 0.0 if decoupled else decay, 1 - lr * decay if decoupled else 1.0


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
            [*_decay_scalars(group, lr), 1 - beta1, beta2, 1 - beta2, group["eps"], 1 - beta2**step,
             -lr * (1.0 - mu) / (1.0 - product), -lr * mu_next / (1.0 - product * mu_next)],
        )


def _radam_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, h: Tensor) -> None:
    shrink, one_minus_beta1, beta2, one_minus_beta2, eps = h[2], h[3], h[4], h[5], h[6]
    bias_correction1, lr, sqrt_bias_correction2, rect = h[7], h[8], h[9], h[10]
    param.mul_(shrink)  # decoupled weight decay (1 without)
    grad = signed_decayed(grad, param, h[0], h[1])
    exp_avg.lerp_(grad, one_minus_beta1)
    exp_avg_sq.mul_(beta2).add_(one_minus_beta2 * grad * grad)
    corrected = exp_avg / bias_correction1
    # Early steps (rect 0: the variance estimate is not yet trusted) take plain momentum steps.
    adaptive = torch.where(rect > 0, (sqrt_bias_correction2 / (exp_avg_sq.sqrt() + eps)) * rect, 1.0)
    param.sub_(corrected * lr * adaptive)


class RAdam(FlatStepMixin, torch.optim.RAdam):
    STATE = (StateSpec("step", "scalar"), StateSpec("exp_avg", "param"), StateSpec("exp_avg_sq", "param"))
    _kernel = elementwise(_radam_update)

    def _step_run(self, group: dict, param: Tensor, grad: Tensor, state: _RunState, grad_scale: Optional[Tensor]) -> None:
        step = state.flat["step"].add_(1).item()
        lr, (beta1, beta2) = float(group["lr"]), group["betas"]
        bias_correction2 = 1 - beta2**step
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step * (beta2**step) / bias_correction2
        rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) if rho_t > 5.0 else 0.0
        self._kernel(
            [param, grad, state.flat["exp_avg"], state.flat["exp_avg_sq"]],
            [*_decay_scalars(group, lr), 1 - beta1, beta2, 1 - beta2, group["eps"], 1 - beta1**step, lr, bias_correction2**0.5,
             rect],
        )
