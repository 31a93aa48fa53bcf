"""GradScaler for fp16 training where the optimizer step runs on another thread.

With asynchronous steps, ``update()`` runs on the caller's thread before the optimizer thread has
looked at the gradients. So the engine does the inf/NaN check itself: while ``forward_backward``
runs, every ``scale()`` call is recorded with the scale it used; when the gradients arrive the
engine checks them on the device and tells the scaler (``_observe``). ``update()`` then needs no
wait, and ``step()`` on the optimizer thread unscales by the scale its gradients were made with,
which may differ from the current one.

Used outside the engine (plain PyTorch), it behaves like ``torch.amp.GradScaler``.
"""
from __future__ import annotations

import contextlib
import math
import threading
import weakref
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from ..thread_setting import setting
from .batching import map_tensors

_local = threading.local()
# Objects with a ``wait_for_steps()`` method (engines): ``update()`` waits for their queued steps
# when no engine-side check was recorded.
_step_queues: "weakref.WeakSet[Any]" = weakref.WeakSet()


def recording_scalers(registry: dict) -> contextlib.AbstractContextManager:
    """Within the block, ``GradScaler.scale`` records ``registry[scaler] = scale``."""
    return setting(_local, "registry", registry)


def step_context(infos: dict) -> contextlib.AbstractContextManager:
    """Within the block, ``GradScaler.step`` uses ``infos[scaler] = (scale, found_inf)``."""
    return setting(_local, "step_infos", infos)


@contextlib.contextmanager
def scaling_by_tensors(factors: dict) -> Iterator[None]:
    """Within the block, ``GradScaler.scale`` multiplies by ``factors[scaler]``: a 0-d fp32 tensor on
    the loss's device, made on first use holding the scale. A recorded CUDA graph then reads the
    scale from memory at each replay instead of the number it was recorded with (wholecall.py)."""
    previous = getattr(_local, "factors", None)
    _local.factors = factors
    try:
        yield
    finally:
        _local.factors = previous


def _times_factor(factors: dict, scaler: "GradScaler", scale: float, t: Tensor) -> Tensor:
    factor = factors.get(scaler)
    if factor is None:
        factor = factors[scaler] = torch.full((), scale, dtype=torch.float32, device=t.device)
    if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
        return (t.float() * factor).to(t.dtype)  # as ``t * scale`` computes: in fp32, rounded once
    return t * factor


def register_step_queue(engine: Any) -> None:
    _step_queues.add(engine)


def _grads_of(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _nonfinite(grads: list[Tensor]) -> bool:
    return any(not bool(torch.isfinite(g).all()) for g in grads)


class GradScaler:
    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ):
        if not (isinstance(init_scale, (int, float)) and init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"GradScaler init_scale must be a positive finite number, got {init_scale!r}")
        self.set_growth_factor(growth_factor)
        self.set_backoff_factor(backoff_factor)
        self.set_growth_interval(growth_interval)
        self._enabled = bool(enabled)
        self._scale = float(init_scale)
        self._growth_tracker = 0
        self._lock = threading.Lock()
        self._observed_inf: Optional[bool] = None  # engine-side checks since the last update()
        self._stepped_inf: list[bool] = []  # checks made by step() itself since the last update()
        self._unscaled: dict[int, bool] = {}  # id(optimizer) -> found_inf of its unscale_()

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    # Getters and setters as torch.amp.GradScaler's (``up_to_date``: the original library's
    # flag; update() here runs on the caller's thread, so every value is current).
    def get_growth_factor(self, up_to_date: bool = False) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        if not new_factor > 1.0:
            raise ValueError(f"GradScaler growth_factor must be > 1, got {new_factor!r}")
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self, up_to_date: bool = False) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        if not 0.0 < new_factor < 1.0:
            raise ValueError(f"GradScaler backoff_factor must be in (0, 1), got {new_factor!r}")
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self, up_to_date: bool = False) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        if not (isinstance(new_interval, int) and new_interval >= 1):
            raise ValueError(f"GradScaler growth_interval must be an integer >= 1, got {new_interval!r}")
        self._growth_interval = new_interval

    def scale(self, outputs: Any) -> Any:
        if not self._enabled:
            return outputs
        scale = self._scale
        registry = getattr(_local, "registry", None)
        if registry is not None:
            registry[self] = scale
        factors = getattr(_local, "factors", None)
        if factors is not None:
            return map_tensors(lambda t: _times_factor(factors, self, scale, t), outputs)
        return map_tensors(lambda t: t * scale, outputs)

    def _observe(self, found_inf: bool) -> None:
        """The engine's verdict on the gradients made with this scaler since the last update()."""
        with self._lock:
            self._observed_inf = bool(found_inf) or bool(self._observed_inf)

    def _scale_for_step(self) -> tuple[float, Optional[bool]]:
        info = (getattr(_local, "step_infos", None) or {}).get(self)
        return info if info is not None else (self._scale, None)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale now (e.g. before clipping them)."""
        if not self._enabled:
            return
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last step()")
        scale, found_inf = self._scale_for_step()
        grads = _grads_of(optimizer)
        if found_inf is None:
            found_inf = _nonfinite(grads)
        if grads:
            torch._foreach_mul_(grads, 1.0 / scale)
        self._unscaled[id(optimizer)] = found_inf

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale and step, or skip the step if the gradients hold inf/NaN."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        scale, found_inf = self._scale_for_step()
        from_engine = found_inf is not None
        unscaled = id(optimizer) in self._unscaled
        if unscaled:
            found_inf = self._unscaled.pop(id(optimizer))
        grads = _grads_of(optimizer)
        if found_inf is None:
            found_inf = _nonfinite(grads)
        result = None
        if not found_inf:
            if unscaled:
                result = optimizer.step(*args, **kwargs)
            elif getattr(optimizer, "_step_supports_amp_scaling", False):
                # Fused Adam divides by grad_scale inside its kernel: no extra pass over the gradients.
                optimizer.grad_scale = torch.tensor(scale, dtype=torch.float32)
                try:
                    result = optimizer.step(*args, **kwargs)
                finally:
                    del optimizer.grad_scale
            else:
                if grads:
                    torch._foreach_mul_(grads, 1.0 / scale)
                result = optimizer.step(*args, **kwargs)
        if not from_engine:
            with self._lock:
                self._stepped_inf.append(bool(found_inf))
        return result

    def update(self, new_scale: Optional[float] = None, is_async: bool = True) -> None:
        """``is_async``: the original library's flag; here the new scale is always current."""
        if not self._enabled:
            return
        if new_scale is not None:
            value = float(new_scale.item() if isinstance(new_scale, Tensor) else new_scale)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"GradScaler.update(new_scale) needs a positive finite number, got {new_scale!r}")
            with self._lock:
                self._scale, self._growth_tracker = value, 0
                self._observed_inf, self._stepped_inf = None, []
            return
        if self._observed_inf is None and not self._stepped_inf:
            for queue in list(_step_queues):  # step() may still be waiting on an optimizer thread
                queue.wait_for_steps()
        with self._lock:
            if self._observed_inf is not None:
                found_inf = self._observed_inf
            elif self._stepped_inf:
                found_inf = any(self._stepped_inf)
            else:
                raise RuntimeError("GradScaler.update(): no inf checks were recorded; call scale() and step() first")
            self._observed_inf, self._stepped_inf = None, []
            if found_inf:
                self._scale *= self._backoff_factor
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    self._scale *= self._growth_factor
                    self._growth_tracker = 0

    def state_dict(self) -> dict:
        if not self._enabled:
            return {}
        return {
            "scale": self._scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._growth_tracker,
        }

    def load_state_dict(self, state: dict) -> None:
        if not self._enabled:
            return
        if not state:
            raise RuntimeError("GradScaler.load_state_dict: the state is empty (saved from a disabled scaler?)")
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} - set(state)
        if missing:
            raise ValueError(f"GradScaler.load_state_dict: missing keys {sorted(missing)}")
        scale = state["scale"]
        self._scale = float(scale.item() if isinstance(scale, Tensor) else scale)
        self._growth_factor = float(state["growth_factor"])
        self._backoff_factor = float(state["backoff_factor"])
        self._growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])
