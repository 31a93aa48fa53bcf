"""Adafactor: a compiled per-parameter update.

Adafactor's second moment is factored into a row and a column vector per matrix, and its step size
and clipping read norms of the whole parameter and update: each parameter's update needs all of that
parameter, so it cannot run over flat runs. torch's for-loop implementation spends most of its time in
small reductions and two host syncs per parameter (2.3 s per ResNet-34 step on one thread); here one
compiled function per parameter rank does the whole update, norms included, on the host's cores.
Parameters off the host, or a process that cannot compile, take torch's own step.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .kernels import compile_enabled, elementwise
from .state_spec import StateSpec, optimizer_memory


def _adafactor_update(param: Tensor, grad: Tensor, row_var: Tensor, col_var: Tensor, variance: Tensor, h: Tensor,
                      factored: bool) -> None:
    sign, shrink, one_minus_beta2_t, rho_t, eps1, eps2, d = h[0], h[1], h[2], h[3], h[4], h[5], h[6]
    grad = grad * sign
    root_numel = param.numel() ** 0.5
    alpha = torch.clamp(torch.linalg.vector_norm(param) / root_numel, min=eps2) * rho_t  # before the decay, as torch
    param.mul_(shrink)
    if factored:
        row_var.lerp_(torch.linalg.vector_norm(grad, dim=-1, keepdim=True).square() / grad.size(-1), one_minus_beta2_t)
        col_var.lerp_(torch.linalg.vector_norm(grad, dim=-2, keepdim=True).square() / grad.size(-2), one_minus_beta2_t)
        estimate = (row_var @ col_var) / row_var.mean(dim=-2, keepdim=True).clamp(min=eps1)
    else:
        variance.lerp_(grad * grad, one_minus_beta2_t)
        estimate = variance
    update = estimate.clamp(min=eps1 * eps1).rsqrt() * grad
    denom = torch.clamp(torch.linalg.vector_norm(update) / (root_numel * d), min=1.0)
    param.sub_(update * (alpha / denom))


class Adafactor(torch.optim.Adafactor):
    _kernel = elementwise(_adafactor_update)  # compiled once per rank (sizes are symbolic)

    @classmethod
    def state_specs(cls, group: dict, shape: torch.Size) -> tuple[StateSpec, ...]:
        if len(shape) > 1:
            return StateSpec("step", "scalar"), StateSpec("row_var", "row"), StateSpec("col_var", "col")
        return StateSpec("step", "scalar"), StateSpec("variance", "param")

    @classmethod
    def state_memory(cls, master_dtype: torch.dtype, **kwargs: Any) -> Any:
        """The engine's optimizer description (rptrain/optim/state.py) of this optimizer with these arguments."""
        return optimizer_memory(cls, master_dtype, kwargs)

    def _compiled_eligible(self) -> bool:
        return compile_enabled() and not self._kernel._failed and all(
            p.device.type == "cpu" and p.is_floating_point() for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None) -> Any:
        if not self._compiled_eligible():
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            row_vars: list[Optional[Tensor]] = []
            col_vars: list[Optional[Tensor]] = []
            variances: list[Optional[Tensor]] = []
            steps: list[Tensor] = []
            self._init_group(group, params, grads, row_vars, col_vars, variances, steps)
            lr, (eps1, eps2) = float(group["lr"]), group["eps"]
            for p, g, row, col, var, step_t in zip(params, grads, row_vars, col_vars, variances, steps):
                eps1_value = torch.finfo(p.dtype).eps if eps1 is None else eps1
                step = step_t.add_(1).item()
                factored = g.dim() > 1
                self._kernel.run_whole(
                    [p, g, row if factored else g, col if factored else g, g if factored else var],
                    [-1.0 if group["maximize"] else 1.0, 1 - lr * group["weight_decay"], step ** group["beta2_decay"],
                     min(lr, 1 / (step**0.5)), eps1_value, eps2, group["d"]],
                    factored=factored,
                )
        return loss
