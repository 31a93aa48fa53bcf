"""What a failed step changed: the master weights, or the state of an optimizer it had begun to step.

A step function that raises before touching anything (a bad closure, clipping that fails, an
optimizer's own checks) leaves the weights exactly as before it, and training can go on. One that
raises after writing part of the master or of an optimizer's state (a kernel failing halfway
through the parameters) leaves a mix of two versions that no later step can undo. Undoing it would
need a copy of the master and every optimizer state made before each step: as much host memory
again as the state itself, and a copy per step, for a failure that ends most runs anyway. So the
damage is detected instead, from the tensors' version counters (every in-place write bumps them,
the flat kernels' raw writes included: optim/kernels.py), and reported: the engine then refuses to
train on, evaluate or hand out the mixed weights until ``load_state_dict`` puts whole ones back.

Engine calls from inside a step function (another step, a forward, a state dict) are refused
(``stepping``): a nested step would apply the bound gradients twice, and one waiting for steps would
wait for itself.

Optimizers are found as they begin to step: ``torch.optim``'s global step pre-hook, filtered to the
step running on this thread, records their state's counters before their first write.
"""
from __future__ import annotations

import contextlib
import operator
import threading
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

_watching = threading.local()  # .optimizers: (optimizer, its state's counters) of the step on this thread
_hook_lock = threading.Lock()
_hook: Optional[Any] = None


def stepping() -> bool:
    """Whether this thread is running a step function."""
    return getattr(_watching, "optimizers", None) is not None


def _counter(t: Any) -> Any:
    if not isinstance(t, Tensor):
        return t if isinstance(t, (int, float, bool, str, type(None))) else id(t)
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no counter: its identity at least
        return id(t)


def _state_counters(optimizer: torch.optim.Optimizer) -> list:
    """Every state value's counter in the state's own order: a value written, added or removed during the step
    changes the list. Read on every step (ResNet-34's 452 values: it was 0.8 ms a step on the H100 with the
    values sorted by name per parameter), so it is one flat pass, a C-level one where every value is a tensor
    with a counter."""
    values = [v for s in optimizer.state.values() for v in s.values()]
    try:
        return list(map(_VERSION, values))
    except (AttributeError, RuntimeError):  # a number, or an inference tensor
        return [_counter(v) for v in values]


_VERSION = operator.attrgetter("_version")


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    seen = getattr(_watching, "optimizers", None)
    if seen is not None and all(o is not optimizer for o, _ in seen):
        seen.append((optimizer, _state_counters(optimizer)))


def _install_hook() -> None:
    global _hook
    with _hook_lock:
        if _hook is None:
            _hook = register_optimizer_step_pre_hook(_before_optimizer_step)


@contextlib.contextmanager
def watch(master: Sequence[Tensor], damage: dict[int, str], version: int) -> Iterator[None]:
    """Run a step; if it raises having changed ``master`` or a stepped optimizer's state,
    ``damage[version]`` says what (read by the caller once it reports the step's error)."""
    _install_hook()
    before = [_counter(p) for p in master]
    outer = getattr(_watching, "optimizers", None)
    stepped = _watching.optimizers = outer if outer is not None else []  # engines sharing one step share the list
    try:
        yield
    except BaseException:
        master_changed = any(_counter(p) != c for p, c in zip(master, before))
        states = sum(_state_counters(opt) != counters for opt, counters in stepped)
        if master_changed or states:
            what = " and ".join(w for w in ("the master weights" if master_changed else "", f"the state of {states} optimizer(s)" if states else "") if w)
            damage[version] = (
                f"the failed step had already written {what}: they are a mix of two versions, so this engine refuses to go on "
                f"with them; load_state_dict() whole weights (and your optimizer's state) from a checkpoint, or make a new engine")
        raise
    finally:
        _watching.optimizers = outer
