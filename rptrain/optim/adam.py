"""Adam and AdamW: torch's fused CPU (and CUDA) kernels called once per flat run of the master weights.

``state_dtype`` keeps the moments in fp32 (default), bf16 or 8 bits per block (lowbit.py); with those,
or a bf16 master, each run takes adam_lowp.py's step (fp32 math, stochastic rounding back to bf16)
instead of torch's kernel. ``state_memory`` tells the engine's fit check what that costs per parameter.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from . import adam_lowp, front
from .flat import FlatState, _FlatRuns, _flat, _span, before_torch_step, on_cpu_or_cuda
from .lowbit import BLOCK
from .state import OptimizerMemory, StateTensor, moments

STATE_DTYPES = ("fp32", "bf16", "int8")
_INT8_STATE = (FlatState("exp_avg", torch.int8, pad=BLOCK), FlatState("exp_avg_scale", torch.float32, block=BLOCK),
               FlatState("exp_avg_sq", torch.uint8, pad=BLOCK), FlatState("exp_avg_sq_scale", torch.float32, block=BLOCK))
_SAME_AS_PARAMS = (FlatState("exp_avg"), FlatState("exp_avg_sq"))


def check_state_dtype(state_dtype: Optional[str]) -> str:
    if state_dtype is None:
        return "fp32"
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype={state_dtype!r}: give one of {', '.join(STATE_DTYPES)}")
    return state_dtype


def _low_precision(param_dtype: torch.dtype, state_dtype: str) -> bool:
    """Whether a run of ``param_dtype`` takes adam_lowp.py's step (else torch's fused kernel, moments in the
    parameters' dtype, as before state_dtype existed)."""
    return state_dtype != "fp32" or param_dtype == torch.bfloat16


def _state_layout(param_dtype: torch.dtype, state_dtype: str) -> tuple[FlatState, ...]:
    if state_dtype == "int8":
        return _INT8_STATE
    if not _low_precision(param_dtype, state_dtype):
        return _SAME_AS_PARAMS
    dtype = torch.bfloat16 if state_dtype == "bf16" else torch.float32
    return (FlatState("exp_avg", dtype), FlatState("exp_avg_sq", dtype))


def _fused_default(params: Any, kwargs: dict) -> tuple[list, dict]:
    params = list(params)
    if "fused" not in kwargs and "foreach" not in kwargs and "differentiable" not in kwargs:
        tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
        kwargs["fused"] = all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors) or None
    return params, kwargs


class _FlatStepMixin:
    _kernel: Callable
    state_dtype: str = "fp32"
    compile_step: bool = True

    @classmethod
    def state_memory(cls, master_dtype: torch.dtype, state_dtype: Optional[str] = None, amsgrad: bool = False,
                     **_: Any) -> OptimizerMemory:
        """The moments' bytes per parameter with a ``master_dtype`` master (engine/fit.py reads this)."""
        state_dtype = check_state_dtype(state_dtype)
        name = f"{cls.__name__}(state_dtype={state_dtype}{', amsgrad' if amsgrad else ''})"
        if state_dtype == "int8":
            per = 1 + 4 / BLOCK  # a code per element, an fp32 scale per block
            memory = OptimizerMemory((StateTensor("exp_avg", torch.int8, per), StateTensor("exp_avg_sq", torch.uint8, per)),
                                     f"{name}: two 8-bit moments, a scale per {BLOCK} elements")
        else:
            dtype = {layout.name: layout.dtype for layout in _state_layout(master_dtype, state_dtype)}["exp_avg"] or master_dtype
            memory = moments(("exp_avg", "exp_avg_sq"), dtype, f"{name}: two {dtype} moments".replace("torch.", ""))
        if amsgrad:  # torch's step keeps a third tensor like the parameters
            memory = OptimizerMemory(memory.tensors + (StateTensor("max_exp_avg_sq", master_dtype, master_dtype.itemsize),), memory.what)
        return memory

    def _init_low_precision(self, state_dtype: Optional[str], compile_step: bool) -> None:
        self.state_dtype, self.compile_step = check_state_dtype(state_dtype), bool(compile_step)
        low = self.state_dtype != "fp32" or any(p.dtype == torch.bfloat16 for g in self.param_groups for p in g["params"])
        if low and not self._flat_eligible():
            raise ValueError(f"{type(self).__name__}: a bf16 master or state_dtype={self.state_dtype} needs the flat step: "
                             "no amsgrad, maximize, capturable, differentiable or fused=False, parameters on a CPU or GPU")

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts floating-point state to the parameters' dtype on load; the moments here keep their own
        (fp32 or bf16 beside a bf16 master, 8-bit codes and fp32 scales), so they load bit for bit."""
        super().load_state_dict(state_dict)  # type: ignore[misc]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(ids, params):
            for key, value in state_dict["state"].get(i, {}).items():
                if key != "step" and isinstance(value, Tensor):
                    self.state[p][key] = value.to(device=p.device)

    def _flat_eligible(self) -> bool:
        d = self.defaults
        if not d.get("fused") or d.get("amsgrad") or d.get("maximize") or d.get("capturable") or d.get("differentiable"):
            return False
        return all(on_cpu_or_cuda(g["params"]) for g in self.param_groups)

    def _torch_step(self, closure: Optional[Callable]) -> Any:
        before_torch_step(self)  # type: ignore[arg-type]
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
                if any(_low_precision(p.dtype, self.state_dtype) for p in group["params"]):
                    raise RuntimeError(f"{type(self).__name__}: parameters or gradients that are not dense alike cannot take the "
                                       f"low-precision step (bf16 master or state_dtype={self.state_dtype})")
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
            decoupled = kernel is torch._fused_adamw_
            flats, step = self._flat_runs.state(run, _state_layout(run[0].dtype, self.state_dtype))
            step += 1
            numel, device = _span(run), run[0].device
            if device not in scales:
                scales[device] = None if grad_scale is None else grad_scale.to(device)
            param = _flat(run[0], numel)
            if _low_precision(run[0].dtype, self.state_dtype):
                h = adam_lowp.hyper(group, step, scales[device])
                adam_lowp.step_run(param, _flat(run[0].grad, numel), flats, step, h, run[0].storage_offset(), decoupled, self.compile_step)
            else:
                kernel(
                    [param], [_flat(run[0].grad, numel)], [flats["exp_avg"]], [flats["exp_avg_sq"]], [], [step],
                    lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                    amsgrad=False, maximize=False, grad_scale=scales[device], found_inf=None,
                )
            front.report(param)  # a call overlapping this step may read the run now (front.py)
        return loss


class Adam(_FlatStepMixin, torch.optim.Adam):
    """torch.optim.Adam; ``state_dtype``: fp32 | bf16 | int8 moments; ``compile_step``: torch.compile the
    low-precision step (bf16 master or moments) at first use."""

    _kernel = staticmethod(torch._fused_adam_)

    def __init__(self, params: Any, *args: Any, state_dtype: Optional[str] = None, compile_step: bool = True, **kwargs: Any):
        params, kwargs = _fused_default(params, kwargs)
        super().__init__(params, *args, **kwargs)
        self._init_low_precision(state_dtype, compile_step)


class AdamW(_FlatStepMixin, torch.optim.AdamW):
    """torch.optim.AdamW; ``state_dtype`` and ``compile_step`` as Adam's."""

    _kernel = staticmethod(torch._fused_adamw_)

    def __init__(self, params: Any, *args: Any, state_dtype: Optional[str] = None, compile_step: bool = True, **kwargs: Any):
        params, kwargs = _fused_default(params, kwargs)
        super().__init__(params, *args, **kwargs)
        self._init_low_precision(state_dtype, compile_step)
