"""Running an elementwise optimizer update over one flat run.

torch's CPU optimizers (other than Adam, AdamW, SGD and Adagrad, which have fused kernels) run an
update as five to ten tensor ops, each a pass over memory. Per parameter tensor that is slow for many
small tensors; over one flat run of 20 M elements it is slower still, because every pass misses the
cache (RMSprop, one thread, this machine: 133 ms per ResNet-34 step per tensor, 240 ms on one flat
tensor). So the update is compiled (inductor's C++ backend) into one loop that reads and writes each
element once: 13 ms for the same step. The first call compiles, once per process and option set
(seconds; bench/optimizer.py measures it); sizes are symbolic and hyperparameters are tensor inputs,
so later runs, learning-rate schedules and new steps reuse it.

Where compiling is switched off (``RPTRAIN_OPTIM_COMPILE=0``) or fails (no C++ compiler), the same
update runs eagerly over cache-sized chunks of the run, at about torch's speed. On a GPU it runs
eagerly over the whole run (a handful of launches per run).
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import Callable, Sequence

import torch
from torch import Tensor

# Elements per eager chunk: the update's tensors for one chunk (about 5 x 256 KiB) stay in L2
# between its passes, as they do for torch's per-tensor loop on a ResNet's tensors.
EAGER_CHUNK = 1 << 16


def compile_enabled() -> bool:
    return os.environ.get("RPTRAIN_OPTIM_COMPILE", "1") != "0"


def signed_decayed(grad: Tensor, param: Tensor, sign: Tensor, weight_decay: Tensor) -> Tensor:
    """torch's gradient preamble as arithmetic, not branches (so no option recompiles): ``sign`` is -1
    to maximize, else 1, and ``weight_decay`` is 0 where none is added; both are then exact no-ops."""
    return grad * sign + weight_decay * param


class Elementwise:
    """``fn(*tensors, h, **flags)`` updates flat tensors in place; ``h`` is one float32 tensor of the
    step's scalars (inputs, so new values never recompile); ``flags`` choose which states exist.
    Scalars derived from hyperparameters (``1 - beta``, bias corrections) are computed on the host in
    double and rounded once, as torch does: in float32 ``1 - 0.99`` is off by 1e-6 relative."""

    def __init__(self, fn: Callable[..., None]):
        self.fn = fn
        self._compiled: Callable[..., None] | None = None
        self._failed = False
        self._lock = threading.Lock()

    def __call__(self, tensors: Sequence[Tensor], scalars: Sequence[float], **flags: bool) -> None:
        """Update a flat run: compiled on the host, else eagerly in cache-sized chunks (or whole on a GPU)."""
        if self._try_compiled(tensors, scalars, flags):
            return
        if tensors[0].device.type != "cpu":
            self.fn(*tensors, torch.tensor(scalars, dtype=torch.float32, device=tensors[0].device), **flags)
            return
        h = torch.tensor(scalars, dtype=torch.float32)
        n = tensors[0].numel()
        for start in range(0, n, EAGER_CHUNK):
            self.fn(*[t[start : start + EAGER_CHUNK] for t in tensors], h, **flags)

    def run_whole(self, tensors: Sequence[Tensor], scalars: Sequence[float], **flags: bool) -> None:
        """Update tensors whose update reads all of them (norms, reductions): compiled, else eagerly."""
        if not self._try_compiled(tensors, scalars, flags):
            self.fn(*tensors, torch.tensor(scalars, dtype=torch.float32, device=tensors[0].device), **flags)

    def _try_compiled(self, tensors: Sequence[Tensor], scalars: Sequence[float], flags: dict) -> bool:
        if tensors[0].device.type != "cpu" or not compile_enabled() or self._failed:
            return False
        try:
            self._compiled_fn()(*[_standalone(t) for t in tensors], torch.tensor(scalars, dtype=torch.float32), **flags)
            for t in tensors:  # the aliases wrote them: autograd's record of in-place changes must see it
                torch.autograd.graph.increment_version(t)
            return True
        except Exception as error:  # no compiler, unsupported platform: torch's speed, not a crash
            self._failed = True
            first_line = str(error).splitlines()[0] if str(error) else ""
            warnings.warn(f"rptrain.optim: compiling {self.fn.__name__} failed ({type(error).__name__}: {first_line}); "
                          "stepping eagerly", RuntimeWarning, stacklevel=3)
            return False

    def _compiled_fn(self) -> Callable[..., None]:
        with self._lock:
            if self._compiled is None:
                self._compiled = torch.compile(self.fn, fullgraph=True)
            return self._compiled


def _standalone(t: Tensor) -> Tensor:
    """``t`` as a tensor of its own on the same memory, its sizes marked dynamic. A flat run is a view
    of the engine's buffer, and dynamo guards on a view's base, whose shape and strides vary from run
    to run: every run would recompile. The scalars' tensor stays static (one size per optimizer)."""
    alias = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    for dim in range(alias.dim()):
        torch._dynamo.maybe_mark_dynamic(alias, dim)
    return alias


def elementwise(fn: Callable[..., None]) -> Elementwise:
    return Elementwise(fn)
